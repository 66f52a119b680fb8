"""The tool API's OpenAPI document drives a fuzzer: schemathesis against the live app, every check, bounded.

The app serves the image tools that answer in milliseconds (crop, sharpen, perspective_correct)
so the run stays short on two cores; the search tools, OCR and EDSR have the same generated
operations (their examples are called in tests/test_serve.py). ``tests/schemathesis_hooks.py``
gives the fuzzer real images (it cannot make PNGs out of random bytes) and, on the generic
route, the tool name that goes with the generated arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def api(ray_cluster):
    from ray import serve

    from osvl.cluster import start_serve
    from serve.app import build_app

    port = start_serve()
    serve.run(build_app({"tools": ["crop", "sharpen", "perspective_correct"]}), name="osvl_tools_fuzz",
              route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("osvl_tools_fuzz")


# positive_data_acceptance: a schema-valid call may still be an invalid_call (422, documented on every operation)
# when what is wrong is beyond a JSON schema: a crop box outside its image, an image argument naming no image. Every
# other check runs with its defaults.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2XX", "3XX", "401", "403", "404", "409", "422", "429", "5XX"]
"""


def test_schemathesis_every_check_passes(api, tmp_path):
    (tmp_path / "schemathesis.toml").write_text(CONFIG)  # read from the working directory
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{api}/openapi.json",
           "--phases=examples,coverage,fuzzing", "--max-examples=10", "--seed=1", "--workers=2",
           "--checks=all",
           "--generation-database=none", "--request-timeout=60", "--no-color"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert "Server error" not in report, report[-4000:]
    assert "Schema validation mismatch" not in report, report[-4000:]
    assert "6 selected / 6 total" in report  # healthz, the tool list, three tools, the generic route
    generated = int(report.split(" generated")[0].rsplit("\n", 1)[-1].strip())
    assert generated >= 6 * 10, report[-2000:]  # every operation was exercised, not skipped
