"""Every PNG osvl makes (matplotlib, headless Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


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
