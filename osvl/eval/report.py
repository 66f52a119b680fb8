"""Tables, summary and chart of an eval run, rebuilt from its per-item records.

One table per benchmark and mode (``tables/<benchmark>__<mode>.md`` and ``.json``): Pass@1
over the items with a verdict, items, failures by kind, mean assistant turns and tool
calls, fatal rate, and, with the LLM judge, how often it agreed with the rule judge on the
items both judged. ``summary.md``/``summary.json`` gather them with the rows the loaders
could not use; ``pass_at_1.png`` is the bar chart by benchmark and mode.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from osvl.plots import pass_at_1_bars


def table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one (benchmark, mode) from its records."""
    n = len(records)
    judged = [r for r in records if r.get("correct") is not None]
    both = [r for r in records if r.get("llm_correct") is not None and r.get("judge_status") == "llm"]
    return {
        "items": n,
        "judged": len(judged),
        "pass_at_1": sum(float(r["correct"]) for r in judged) / len(judged) if judged else 0.0,
        "failures": dict(sorted(Counter(r["failure"] for r in records if r.get("failure")).items())),
        "mean_turns": sum(r.get("turns", 0) for r in records) / n if n else 0.0,
        "mean_tool_calls": sum(r.get("tool_calls", 0) for r in records) / n if n else 0.0,
        "fatal_rate": sum(bool(r.get("fatal")) for r in records) / n if n else 0.0,
        "judge_agreement": (sum(float(r["rule_correct"]) == float(r["llm_correct"]) for r in both) / len(both)
                            if both else None),
        "judge_failed": sum(r.get("judge_status") == "judge_failed" for r in records),
    }


def markdown(bench: str, mode: str, t: dict[str, Any]) -> str:
    fails = ", ".join(f"{k} {v}" for k, v in t["failures"].items()) or "none"
    agree = "n/a" if t["judge_agreement"] is None else f"{t['judge_agreement']:.1%}"
    return (f"### {bench} / {mode}\n\n| Pass@1 | items | judged | mean turns | mean tool calls | fatal rate | "
            f"rule/LLM agreement |\n|---|---|---|---|---|---|---|\n| {100 * t['pass_at_1']:.1f} | {t['items']} | "
            f"{t['judged']} | {t['mean_turns']:.2f} | {t['mean_tool_calls']:.2f} | {t['fatal_rate']:.2f} | "
            f"{agree} |\n\nFailures: {fails}.\n")


def write_reports(out: Path, records: list[dict[str, Any]], benches: list[Any], modes: list[str],
                  extra: dict[str, Any]) -> dict[str, Any]:
    """Write the tables, summary and chart under ``out``; return the summary."""
    tables_dir = out / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault((r["benchmark"], r["mode"]), []).append(r)
    summary: dict[str, Any] = {**extra, "benchmarks": {}}
    parts = [f"# Eval: {extra.get('model', '')}\n"]
    scores: dict[str, dict[str, float]] = {}
    for b in benches:
        entry: dict[str, Any] = {"file": b.path, "format": b.format, "items": len(b.items),
                                 "not_loaded": len(b.problems), "problems": b.problems[:50], "modes": {}}
        for mode in modes:
            recs = by.get((b.name, mode), [])
            t = table(recs)
            entry["modes"][mode] = t
            scores.setdefault(b.name, {})[mode] = t["pass_at_1"]
            text = markdown(b.name, mode, t)
            (tables_dir / f"{b.name}__{mode}.md").write_text(text)
            (tables_dir / f"{b.name}__{mode}.json").write_text(json.dumps(t, indent=1))
            parts.append(text)
        if b.problems:
            lines = "; ".join(f"line {p['line']}: {p['detail']}" for p in b.problems[:5])
            parts.append(f"{b.name}: {len(b.problems)} rows not loaded ({lines}{' ...' if len(b.problems) > 5 else ''})"
                         "\n")
        summary["benchmarks"][b.name] = entry
    (out / "summary.md").write_text("\n".join(parts))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False, default=str))
    pass_at_1_bars(scores, out / "pass_at_1.png", title=f"Pass@1: {extra.get('model', '')}")
    return summary
