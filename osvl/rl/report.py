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


