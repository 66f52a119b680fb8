"""What a GRPO run reports: the per-step table the driver prints and the summary of a run.

``summarize`` compares the mean reward of the first and last steps (with standard errors, so the
demo's verdict "reward went up" is a test, not an impression) and counts the clamp split.
"""

from __future__ import annotations

import json
from typing import Any


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, (var / n) ** 0.5


def paired_interval(xs: list[float], ys: list[float], level: float = 0.95) -> dict[str, float]:
    """Mean of the paired differences x - y with its t-based interval (n - 1 degrees of freedom).

    Pairs share their randomness (a seed's questions and draws), so their difference has a smaller
    spread than either side; with 3 pairs the 95% interval is ±4.3 SE, so small n says little.
    """
    from scipy.stats import t as student

    d = [x - y for x, y in zip(xs, ys, strict=True)]
    m, se = mean_se(d)
    half = float(student.ppf(0.5 + level / 2, len(d) - 1)) * se if len(d) > 1 else float("nan")
    return {"diff": m, "lo": m - half, "hi": m + half, "se": se, "n": len(d)}


def clustered_mean_se(xs: list[float], clusters: list[str]) -> tuple[float, float]:
    """Mean of ``xs`` and its cluster-robust standard error (clusters: e.g. the seed entity per question).

    Held-out questions of one seed entity share its picture and neighbourhood, so they succeed or
    fail together; the i.i.d. SE would count 100 questions of 10 seeds as 100 independent draws.
    SE^2 = G/(G-1) * sum_g (sum_{i in g} (x_i - mean))^2 / n^2 (the CR1 sandwich of a mean). For paired
    comparisons pass the per-question differences.
    """
    n = len(xs)
    if n == 0 or len(clusters) != n:
        return float("nan"), float("nan")
    m = sum(xs) / n
    sums: dict[str, float] = {}
    for x, c in zip(xs, clusters, strict=True):
        sums[c] = sums.get(c, 0.0) + (x - m)
    g = len(sums)
    if g < 2:
        return m, float("nan")
    return m, (g / (g - 1) * sum(v * v for v in sums.values())) ** 0.5 / n


def heldout_report(questions: list[dict[str, Any]], before: dict[str, list[float]] | None,
                   after: dict[str, list[float]] | None) -> dict[str, Any]:
    """Held-out Pass@1 after SFT and after GRPO per eval mode, each with its seed-clustered SE, and the paired
    GRPO - SFT difference of agentic Pass@1 with its clustered SE (``better``: above 2 SE); None where a side
    was not scored. ``before``/``after`` map an eval mode to per-question scores in ``questions`` order."""
    from osvl.rl.trainer import seed_entity

    seeds = [seed_entity(q) for q in questions]
    out: dict[str, Any] = {"heldout": len(questions), "heldout_seeds": len(set(seeds))}
    for side, scores in (("sft", before), ("grpo", after)):
        for mode in ("agentic", "direct"):
            key = "pass1" if mode == "agentic" else "direct"
            m, se = clustered_mean_se(scores[mode], seeds) if scores and mode in scores else (None, None)
            out[f"{key}_{side}"], out[f"{key}_{side}_se"] = m, se
    diff = diff_se = None
    if before and after:
        diff, diff_se = clustered_mean_se([a - b for a, b in zip(after["agentic"], before["agentic"], strict=True)],
                                          seeds)
    out.update(pass1_diff=diff, pass1_diff_se=diff_se,
               better=diff is not None and diff_se is not None and diff > 2 * diff_se)
    return out


def held_line(h: dict[str, Any]) -> str:
    """The summary's held-out line: Pass@1 ± clustered SE after SFT and after GRPO, the paired difference, direct."""
    def num(key: str) -> str:
        m, se = h.get(key), h.get(f"{key}_se")
        return "n/a" if m is None else f"{m:.3f} ± {se:.3f}" if se == se and se is not None else f"{m:.3f}"

    diff = "" if h["pass1_diff"] is None else (
        f"; GRPO - SFT {num('pass1_diff')} (paired, {'>' if h['better'] else 'not >'} 2 SE)")
    return (f"  held-out Pass@1 ({h['heldout']} questions of {h['heldout_seeds']} seed entities, greedy, SE clustered "
            f"by seed): after SFT {num('pass1_sft')}, after GRPO {num('pass1_grpo')}{diff}; direct mode (no tools) "
            f"after SFT {num('direct_sft')}, after GRPO {num('direct_grpo')}")


def summarize(rows: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """First vs last ``window`` steps' mean reward (with standard errors), the clamp split, the staleness mix."""
    rewards = [r["reward"] for r in rows]
    first, last = mean_se(rewards[:window]), mean_se(rewards[-window:])
    clamped = sum(r.get("clamped", 0) for r in rows)
    kept = sum(r.get("kept_positive", 0) for r in rows)
    fatal = clamped + kept
    return {"steps": len(rows), "first_mean": first[0], "first_se": first[1], "last_mean": last[0],
            "last_se": last[1], "improved": last[0] - first[0] > 2 * (first[1] ** 2 + last[1] ** 2) ** 0.5,
            "clamped": clamped, "kept_positive": kept,
            "clamped_share": clamped / fatal if fatal else float("nan"),
            "fatal_rate": sum(r["fatal_rate"] for r in rows) / max(1, len(rows)),
            "skipped": sum(bool(r.get("skipped")) for r in rows),
            "staleness": rows[-1]["staleness"] if rows else {}}


COLUMNS = (("step", "{:>4d}"), ("reward", "{:6.3f}"), ("r_fmt", "{:5.2f}"), ("r_acc", "{:5.2f}"),
           ("r_query", "{:5.2f}"), ("fatal_rate", "{:5.2f}"), ("clamped", "{:>3d}"), ("kept_positive", "{:>3d}"),
           ("mask_coverage", "{:5.2f}"), ("kl", "{:7.4f}"), ("entropy", "{:5.2f}"), ("clip_fraction", "{:5.3f}"),
           ("step_s", "{:6.1f}"), ("wait_s", "{:6.1f}"), ("buffer_ready", "{:>3d}"))
HEADER = ("step reward r_fmt r_acc r_qry fatal clp kep  mask      kl   ent  clip  step_s  wait_s buf  staleness")


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for key, spec in COLUMNS:
        v = row.get(key)
        cells.append(spec.format(v) if v is not None else "-")
    return " ".join(cells) + "  " + json.dumps(row.get("staleness", {}))


