"""Dashboards are generated from osvl.metrics and the committed JSON is current."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_committed_dashboards_match_metric_specs():
    sys.path.insert(0, str(REPO / "dashboards"))
    import build  # dashboards/build.py

    expected = build.build()
    committed = {p.name: json.loads(p.read_text()) for p in (REPO / "dashboards").glob("osvl-*.json")}
    assert committed == expected, "dashboards are stale: run `python dashboards/build.py`"


def test_every_metric_has_a_panel_and_every_panel_a_metric():
    from osvl.metrics import SPECS, prometheus_name

    exprs = " ".join(t["expr"] for p in (REPO / "dashboards").glob("osvl-*.json")
                     for panel in json.loads(p.read_text())["panels"] for t in panel["targets"])
    for spec in SPECS.values():
        assert prometheus_name(spec) in exprs, spec.name
    titles = {panel["title"] for p in (REPO / "dashboards").glob("osvl-*.json")
              for panel in json.loads(p.read_text())["panels"]}
    assert titles == set(SPECS)


def test_prometheus_config_parses():
    cfg = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
    assert cfg["scrape_configs"][0]["file_sd_configs"][0]["files"]


def test_build_script_runs(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "dashboards" / "build.py")], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "wrote dashboards/osvl-tool.json" in out.stdout
