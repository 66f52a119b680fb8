"""Every PNG osvl makes is drawn here (matplotlib, the non-interactive Agg backend).

One function per figure kind; callers hand over plain data (no Prometheus or Ray types), so a
figure can be redrawn from saved numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osvl.storage import atomic


@dataclass
class Panel:
    """One dashboard panel: a title, a unit for the y axis, and named time series ``(unix times, values)``."""

    title: str
    unit: str = ""
    series: list[tuple[str, list[float], list[float]]] = field(default_factory=list)
    section: str = ""  # the dashboard the panel comes from, shown above its title


def dashboard_grid(panels: list[Panel], out: str | Path, title: str = "", columns: int = 4,
                   dpi: int = 90) -> Path:
    """Draw ``panels`` as a grid of small time-series plots (minutes since the first sample on x) into ``out``.

    Panels without data say so instead of being dropped, so a missing series is visible. Legends show
    at most 6 series (the rest are drawn, not named) to keep the panels readable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    starts = [t[0] for p in panels for _, t, _ in p.series if t]
    t0 = min(starts) if starts else 0.0
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title((f"{panel.section}: " if panel.section else "") + panel.title, fontsize=10)
        ax.tick_params(labelsize=9)
        if not panel.series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for i, (name, times, values) in enumerate(panel.series):
            ax.plot([(t - t0) / 60 for t in times], values, lw=1.4, label=name if i < 6 else None)
        ax.set_xlabel("minutes since the first sample", fontsize=9)
        unit = {"s": "seconds", "percentunit": "share (0-1)"}.get(panel.unit, panel.unit.removeprefix("suffix:"))
        ax.set_ylabel(unit.strip() or panel.title.rsplit("_", 1)[-1], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best", frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()) if title else None)  # room for the title
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def pass_at_1_bars(scores: dict[str, dict[str, float]], path: str | Path, title: str = "Pass@1") -> Path:
    """Grouped bars: one group per benchmark, one bar per mode. ``scores[benchmark][mode]`` in [0, 1]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(scores)
    modes = sorted({m for s in scores.values() for m in s}, key=["direct", "rag", "agentic"].index)
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(benches) + 1.5), 3.2))
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(benches))]
        vals = [100 * scores[b].get(mode, 0.0) for b in benches]
        bars = ax.bar(xs, vals, width, label=mode)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(benches)), benches, fontsize=8)
    ax.set_ylabel("Pass@1 (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_curves(log_file: str | Path, panels: list[tuple[str, list[str]]], out: str | Path,
                    title: str = "") -> Path:
    """Training curves from a step log (JSON lines with a ``step`` key) into ``out``: one panel per
    ``(title, keys)``, one line per key, step on x.

    A step logged twice (a resumed run repeats the steps after its last checkpoint) counts once, the
    later line. Keys no row has leave their panel saying "no data". The PNG is written beside ``out``
    and renamed into place, so a reader (or an upload) never sees half of one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step: dict[int, dict] = {}
    for line in Path(log_file).read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "step" in row:
            by_step[int(row["step"])] = row
    rows = [by_step[k] for k in sorted(by_step)]
    columns = min(3, len(panels))
    nrows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(nrows, columns, figsize=(4.2 * columns, 2.8 * nrows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels, strict=False):
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)
                   and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, marker="." if len(pts) < 30 else None,
                        label=key)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            continue
        ax.set_xlabel("step", fontsize=7)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7, frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()

    with atomic(out) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return Path(out)


def _mean_band(ax: Any, runs: list[list[float]], label: str) -> None:
    """The mean over runs of each point, shaded ± one standard error (one run draws no band)."""
    steps = min(len(r) for r in runs)
    means, ses = [], []
    for i in range(steps):
        xs = [r[i] for r in runs]
        m = sum(xs) / len(xs)
        var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
        means.append(m)
        ses.append(math.sqrt(var / len(xs)))
    x = list(range(1, steps + 1))
    ax.plot(x, means, label=f"{label} ({len(runs)} seeds)")
    low = [m - s for m, s in zip(means, ses, strict=True)]
    ax.fill_between(x, low, [m + s for m, s in zip(means, ses, strict=True)], alpha=0.2)


def reward_curves(curves: dict[str, list[list[float]]], path: str | Path,
                  title: str = "GRPO reward per step") -> Path:
    """One line per mode: the mean over seeds of each step's reward, shaded ± one standard error.

    ``curves[mode]`` holds one list of per-step rewards per seed (equal lengths); one seed draws no band.
    """
    return curve_grid({title: curves}, path, xlabel="learner step", ylabel="mean reward")


def curve_grid(panels: dict[str, dict[str, list[list[float]]]], path: str | Path, xlabel: str, ylabel: str,
               columns: int = 2) -> Path:
    """One panel per key (its title), one line per mode in it: mean over seeds ± one standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(columns, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels.items(), strict=False):
        for mode, runs in curves.items():
            _mean_band(ax, runs, mode)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
