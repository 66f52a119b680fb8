"""Generate the Grafana dashboards from ``osvl.metrics.SPECS``.

Why generated: every metric osvl exports is declared once in ``osvl/metrics.py``;
deriving the panels from those specs means a new metric gets a panel and a
renamed one cannot leave a dead panel behind (``tests/test_dashboards.py`` checks
that the committed JSON equals what this script writes).

One dashboard per metric area (the second word of the name: ``osvl_tool_*`` ->
``osvl-tool.json``). Every query selects ``{osvl_job=~"$osvl_job", run=~"$run"}`` (two
dashboard variables, "All" by default) and keeps those two labels, so two runs on one
cluster are two lines. Panel queries by kind:
- counter: per-second rate, summed by the metric's tags;
- gauge: current value, summed by tags (Ray's own node/worker labels summed away);
- histogram: p50 and p99 over 5 minutes, by osvl_job, run and the metric's first own tag.

``dashboards/render.py`` draws the same panels from a Prometheus server into one PNG.

    python dashboards/build.py          # rewrite dashboards/osvl-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from osvl.metrics import LABELS, SPECS, MetricSpec, prometheus_name  # noqa: E402  (needs the sys.path line)

SELECT = '{osvl_job=~"$osvl_job", run=~"$run"}'


def _targets(spec: MetricSpec) -> list[dict]:
    name = prometheus_name(spec)
    by = ", ".join(spec.tag_keys)
    legend = " ".join("{{" + t + "}}" for t in spec.tag_keys)
    if spec.kind == "counter":
        return [{"expr": f"sum by ({by}) (rate({name}{SELECT}[1m]))", "legendFormat": legend, "refId": "A"}]
    if spec.kind == "gauge":
        return [{"expr": f"sum by ({by}) ({name}{SELECT})", "legendFormat": legend, "refId": "A"}]
    group = ", ".join(("le",) + LABELS + spec.own_tags[:1])
    legend = " ".join("{{" + t + "}}" for t in LABELS + spec.own_tags[:1])
    out = []
    for ref, q in (("A", 0.5), ("B", 0.99)):
        expr = f"histogram_quantile({q}, sum by ({group}) (rate({name}_bucket{SELECT}[5m])))"
        out.append({"expr": expr, "legendFormat": f"p{int(q * 100)} {legend}", "refId": ref})
    return out


def _variable(label: str) -> dict:
    """A multi-value dashboard variable over the values of ``label`` on osvl's series ("All" = any)."""
    query = f'label_values({{__name__=~"ray_osvl_.+"}}, {label})'
    return {"name": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": query, "definition": query, "refresh": 2, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}}


def _unit(spec: MetricSpec) -> str:
    """Grafana's unit of a panel, from the metric's name (Prometheus naming: the unit is the last word) and kind (a
    counter is drawn as its rate); ``suffix: X`` is Grafana's custom unit, a number followed by X."""
    words = spec.name.split("_")
    if words[-2] == "per":  # tokens_per_second, tool_calls_per_episode
        return f"suffix: {words[-3]}/s" if words[-1] == "second" else f"suffix: {words[-3]}"
    if spec.kind == "counter":
        return f"suffix: {words[-1]}/s"
    if words[-1] == "seconds":
        return "s"
    if words[-1] == "bytes":
        return "bytes"
    if words[-1] == "ratio":
        return "percentunit"  # a share in [0, 1], drawn as a percentage
    return "short"


def dashboard(area: str, specs: list[MetricSpec]) -> dict:
    panels = []
    for i, spec in enumerate(specs):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": spec.name,
            "description": spec.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": _unit(spec)}, "overrides": []},
            "targets": _targets(spec),
        })
    return {
        "uid": f"osvl-{area}",
        "title": f"osvl / {area}",
        "tags": ["osvl"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"},
                                _variable("osvl_job"), _variable("run")]},
        "panels": panels,
    }


def build() -> dict[str, dict]:
    """File name -> dashboard JSON, for every metric area."""
    areas: dict[str, list[MetricSpec]] = {}
    for spec in SPECS.values():
        areas.setdefault(spec.name.split("_")[1], []).append(spec)
    return {f"osvl-{area}.json": dashboard(area, specs) for area, specs in sorted(areas.items())}


def main() -> None:
    for old in HERE.glob("osvl-*.json"):
        old.unlink()
    for name, board in build().items():
        (HERE / name).write_text(json.dumps(board, indent=2) + "\n")
        print(f"wrote dashboards/{name} ({len(board['panels'])} panels)")


if __name__ == "__main__":
    main()
