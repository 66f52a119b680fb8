"""What a GRPO run reports, all rendered here: the per-step table the driver prints, the run's ``Summary``
(``report.json``), its closing lines and the one-line verdict ``jobs/grpo.py`` (``make demo``) ends with.

``summarize`` compares the mean reward of the first and last steps (with standard errors, so the
demo's verdict "reward went up" is a test, not an impression) and counts the clamp split.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from scipy.stats import t as student

from osvl.rl.loss import MODES
from osvl.rl.trainer import seed_entity


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


@dataclasses.dataclass
class Summary:
    """A GRPO run's results, written as ``report.json`` (the same keys); None where a side was not scored."""

    steps: int  # GRPO steps trained
    first_mean: float  # mean reward of the first 10 steps, and its SE
    first_se: float
    last_mean: float  # ... of the last 10 steps
    last_se: float
    improved: bool  # last - first above 2 SE of the difference
    clamped: int  # fatal trajectories whose negative advantage was clamped to 0 (counted in every mode)
    kept_positive: int  # fatal trajectories with a positive advantage, kept
    clamped_share: float
    fatal_rate: float  # mean over steps
    skipped: int  # non-finite steps skipped
    staleness: dict[str, int]  # policy versions behind, of the last step's groups
    heldout: int = 0  # held-out questions scored, and their seed entities
    heldout_seeds: int = 0
    pass1_sft: float | None = None  # greedy agentic Pass@1 after SFT, with its seed-clustered SE
    pass1_sft_se: float | None = None
    direct_sft: float | None = None  # ... direct mode (one turn, no tools)
    direct_sft_se: float | None = None
    pass1_grpo: float | None = None  # ... after GRPO
    pass1_grpo_se: float | None = None
    direct_grpo: float | None = None
    direct_grpo_se: float | None = None
    pass1_diff: float | None = None  # paired GRPO - SFT agentic Pass@1, with its clustered SE
    pass1_diff_se: float | None = None
    better: bool = False  # pass1_diff above 2 paired SE
    seconds: float = 0.0  # the GRPO stage, its evaluations included
    chain_s: float | None = None  # the whole chain, upstream stages built or reused included (osvl.recipe)
    train_s: float = 0.0  # the GRPO steps alone
    issued: int = 0  # groups issued, trained, dropped, flat ones re-drawn
    consumed: int = 0
    dropped: int = 0
    resampled: int = 0
    restarts: list[Any] = dataclasses.field(default_factory=list)  # rollout-actor restarts
    resumed_from: str | None = None  # the checkpoint a resumed run started at
    mode: str = ""  # rl.mode
    out: str = ""  # the run folder


def summarize(rows: list[dict[str, Any]], window: int = 10) -> Summary:
    """First vs last ``window`` steps' mean reward (with standard errors), the clamp split, the staleness mix."""
    rewards = [r["reward"] for r in rows]
    first, last = mean_se(rewards[:window]), mean_se(rewards[-window:])
    clamped = sum(r.get("clamped", 0) for r in rows)
    kept = sum(r.get("kept_positive", 0) for r in rows)
    fatal = clamped + kept
    return Summary(steps=len(rows), first_mean=first[0], first_se=first[1], last_mean=last[0], last_se=last[1],
                   improved=last[0] - first[0] > 2 * (first[1] ** 2 + last[1] ** 2) ** 0.5,
                   clamped=clamped, kept_positive=kept, clamped_share=clamped / fatal if fatal else float("nan"),
                   fatal_rate=sum(r["fatal_rate"] for r in rows) / max(1, len(rows)),
                   skipped=sum(bool(r.get("skipped")) for r in rows),
                   staleness=rows[-1]["staleness"] if rows else {})


def _num(m: float | None, se: float | None = None) -> str:
    return "n/a" if m is None else f"{m:.3f} ± {se:.3f}" if se is not None and se == se else f"{m:.3f}"


def summary_lines(s: Summary, buffer: dict[str, Any], events: list[str]) -> list[str]:
    """The run's closing lines: reward trend, clamp split, group accounting, held-out Pass@1."""
    clamps = MODES[s.mode].clamp_fatal
    fatal = s.clamped + s.kept_positive
    drops = [e for e in events if e.startswith("dropped")]
    diff = "" if s.pass1_diff is None else (
        f"; GRPO - SFT {_num(s.pass1_diff, s.pass1_diff_se)} (paired, {'>' if s.better else 'not >'} 2 SE)")
    return [
        f"\ngrpo summary ({s.mode}): {s.steps} steps in {s.train_s:.0f} s "
        f"({3600 * s.steps / max(s.train_s, 1e-9):.0f} steps/hour)",
        f"  mean reward, first 10 steps: {s.first_mean:.4f} ± {s.first_se:.4f} (SE); last 10: {s.last_mean:.4f} ± "
        f"{s.last_se:.4f}; {'higher by more than 2 SE' if s.improved else 'NOT higher by more than 2 SE'}",
        f"  clamp split{'' if clamps else f' ({s.mode} does not clamp)'}: of {fatal} fatal trajectories with a "
        f"non-zero advantage, {s.clamped} negative{' -> clamped to 0' if clamps else ''}, {s.kept_positive} positive "
        "kept" + (f" ({s.clamped_share:.1%} / {1 - s.clamped_share:.1%})" if fatal else "")
        + f"; mean fatal rate {s.fatal_rate:.2f}",
        f"  groups: {s.issued} issued, {s.consumed} trained, {s.dropped} dropped, {s.resampled} flat ones re-drawn"
        + (f" ({'; '.join(drops[:3])})" if drops else "") + f"; staleness of trained groups {buffer['staleness']}; "
        f"{len(s.restarts)} rollout-actor restarts; {s.skipped} non-finite steps skipped",
        f"  held-out Pass@1 ({s.heldout} questions of {s.heldout_seeds} seed entities, greedy, SE clustered by seed): "
        f"after SFT {_num(s.pass1_sft, s.pass1_sft_se)}, after GRPO {_num(s.pass1_grpo, s.pass1_grpo_se)}{diff}; "
        f"direct mode (no tools) after SFT {_num(s.direct_sft, s.direct_sft_se)}, after GRPO "
        f"{_num(s.direct_grpo, s.direct_grpo_se)}"]


def verdict(label: str, s: Summary, steps: int, n_heldout: int) -> tuple[bool, str]:
    """``jobs/grpo.py``'s last line (``make demo``'s; a test greps it): whether the whole chain ran, its figures."""
    evals = n_heldout == 0 or (s.pass1_sft is not None and s.pass1_grpo is not None)
    if s.steps < steps or not evals:
        return False, (f"{label}: FAILED — {s.steps} of {steps} GRPO steps trained, held-out evaluation "
                       f"{'done' if evals else 'missing'}; see {s.out}")
    return True, (
        f"{label}: OK — questions, expert trajectories, SFT and {s.steps} GRPO steps ({s.mode}) in "
        f"{(s.seconds if s.chain_s is None else s.chain_s) / 60:.1f} min; mean reward first 10 steps "
        f"{s.first_mean:.3f} ± {s.first_se:.3f}, last 10 {s.last_mean:.3f} ± {s.last_se:.3f} "
        f"({'up' if s.improved else 'NOT up'} by > 2 SE); "
        f"held-out Pass@1 after SFT {_num(s.pass1_sft, s.pass1_sft_se)}, after GRPO "
        f"{_num(s.pass1_grpo, s.pass1_grpo_se)} (GRPO - SFT {_num(s.pass1_diff, s.pass1_diff_se)}, "
        f"{'>' if s.better else 'not >'} 2 paired SE), direct mode after GRPO {_num(s.direct_grpo, s.direct_grpo_se)}")


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


