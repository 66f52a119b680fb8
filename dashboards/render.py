"""Render the dashboards' panels from a Prometheus server into one PNG (no Grafana needed).

    python dashboards/render.py --prometheus=http://127.0.0.1:9090 --minutes=30 --out=dashboards.png
    python dashboards/render.py --prometheus=... --boards=rl,rollout,engine --run=RUN --skip-empty
    python dashboards/render.py --prometheus=... --boards=rl --panels=osvl_rl_reward,osvl_rl_fatal_ratio --columns=2

It reads the committed ``dashboards/osvl-*.json`` (what Grafana would show), sets the dashboard
variables ``$osvl_job`` and ``$run`` (regexes; ".*" = all), asks Prometheus's ``/api/v1/query_range``
for every panel query over the window, names each series by the query's ``legendFormat`` and draws
the panels with ``osvl.plots.dashboard_grid``. A query Prometheus rejects is an error (the panels are
generated, so that is a bug to fix, not a panel to skip).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from osvl.errors import DataError  # noqa: E402  (needs the sys.path line)
from osvl.plots import Panel, dashboard_grid  # noqa: E402


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """The ``result`` of one range query (a list of ``{"metric": labels, "values": [[t, "v"], ...]}``)."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
    if body.get("status") != "success":
        raise DataError(f"Prometheus rejected {expr!r}: {body.get('error', body)}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or str(labels)


def panels(base: str, boards: list[str], start: float, end: float, step: float, job: str, run: str) -> list[Panel]:
    out = []
    for area in boards:
        board = json.loads((HERE / f"osvl-{area}.json").read_text())
        for p in board["panels"]:
            unit = p["fieldConfig"]["defaults"].get("unit", "")
            panel = Panel(p["title"], "" if unit == "short" else unit, section=area)  # Grafana's "short": a number
            for target in p["targets"]:
                expr = target["expr"].replace("$osvl_job", job).replace("$run", run)
                for s in query_range(base, expr, start, end, step):
                    points = [(float(t), float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
                    if points:
                        panel.series.append((legend(target["legendFormat"], s["metric"]),
                                             [t for t, _ in points], [v for _, v in points]))
            out.append(panel)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    ap.add_argument("--boards", default="", help="comma-separated areas (rl,rollout,...); empty = every dashboard")
    ap.add_argument("--minutes", type=float, default=30.0, help="window length, ending at --end")
    ap.add_argument("--end", type=float, default=0.0, help="window end, unix seconds (0 = now)")
    ap.add_argument("--step", type=float, default=0.0, help="query resolution in seconds (0 = window / 240)")
    ap.add_argument("--osvl-job", default=".*", help="regex for the osvl_job label")
    ap.add_argument("--run", default=".*", help="regex for the run label")
    ap.add_argument("--skip-empty", action="store_true", help="leave out panels without data")
    ap.add_argument("--panels", default="", help="comma-separated metric names (panel titles) to draw, in that order; "
                                                 "empty = every panel of the boards")
    ap.add_argument("--columns", type=int, default=4)
    ap.add_argument("--title", default="")
    ap.add_argument("--out", default="dashboards.png")
    args = ap.parse_args(argv)
    boards = [b for b in args.boards.split(",") if b] or sorted(
        p.stem.removeprefix("osvl-") for p in HERE.glob("osvl-*.json"))
    end = args.end or time.time()
    start = end - 60 * args.minutes
    step = args.step or max(1.0, (end - start) / 240)
    drawn = panels(args.prometheus.rstrip("/"), boards, start, end, step, args.osvl_job, args.run)
    if args.panels:  # a readable picture of a few panels instead of every one
        wanted = [w for w in args.panels.split(",") if w]
        by_title = {p.title: p for p in drawn}
        missing = [w for w in wanted if w not in by_title]
        if missing:
            raise DataError(f"--panels: no panel {', '.join(missing)} on boards {', '.join(boards)}")
        drawn = [by_title[w] for w in wanted]
    if args.skip_empty:
        drawn = [p for p in drawn if p.series]
    if not drawn:
        raise DataError("no panel has data in that window (check --prometheus, --minutes, --run)")
    out = dashboard_grid(drawn, args.out, title=args.title, columns=args.columns)
    with_data = sum(bool(p.series) for p in drawn)
    print(f"wrote {out} ({len(drawn)} panels, {with_data} with data, {out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
