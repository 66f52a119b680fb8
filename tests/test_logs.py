"""osvl/logs.py: one log format and --log_level on every job; progress as a bar in a terminal, lines elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")


def _job(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    """jobs/build_kg.py on a missing input: it logs its config, then stops with a ConfigError (one line, exit 2)
    before any cluster."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OSVL_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "jobs/build_kg.py", f"--input={tmp}/missing.xml.bz2",
                           f"--run.root={tmp}/runs", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_log_level_sets_what_a_job_logs(tmp_path: Path) -> None:
    default = _job(tmp=tmp_path)
    # a ConfigError is one line on stderr with exit code 2 (osvl.config.cli), never a traceback
    assert default.returncode == 2 and default.stderr.startswith("error: input"), default.stderr[-800:]
    assert "Traceback" not in default.stderr
    first = default.stdout.splitlines()[0]
    assert LINE.match(first) and first.endswith("osvl.logs: build_kg config:"), default.stdout[:500]
    assert "shard_pages:" in default.stdout  # the resolved config follows
    quiet = _job("--log_level=warning", tmp=tmp_path)
    assert quiet.stdout == "" and quiet.stderr.startswith("error: input")
    bad = _job("--log_level=loud", tmp=tmp_path)
    assert "error: --log_level: 'loud' is not one of debug, info, warning, error" in bad.stderr
