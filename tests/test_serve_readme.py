"""Every command of serve/README.md, run as written (port 8000 swapped for a free one).

The servers join this session's Ray cluster through ``RAY_ADDRESS`` (as the README says they
may) instead of starting clusters of their own. The official-weights path is served by a
checkpoint in basicsr's official layout (``{"params": ...}`` of EDSR-M x4, no osvl metadata)
written to a temporary file, since no weights can be downloaded here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from osvl.cluster import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README = REPO / "serve" / "README.md"
OFFICIAL = "weights/EDSR_Mx4_f64b16_DIV2K_official-3ba7b086.pth"


def blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            app = serve.status().applications.get("osvl_tools")
        except Exception:  # noqa: BLE001 - Serve not started yet by the subprocess
            app = None
        if app is not None and str(app.status).endswith("DEPLOY_FAILED"):
            raise AssertionError(f"deploy failed: {app.message[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _shell(cmd: str, env: dict) -> list[str]:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


@pytest.fixture
def env(ray_cluster):
    from ray import serve

    serve.shutdown()  # the README servers start Serve themselves, on their own port
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address_info["gcs_address"]}
    env.pop("OSVL_TOOLS_TOKEN", None)
    yield env
    serve.shutdown()


def test_readme_has_the_blocks_this_test_runs():
    b = blocks()
    assert len(b) == 5
    assert b[0].startswith(".venv/bin/python -m serve.app") and "OSVL_TOOLS_TOKEN=" in b[2]
    assert b[4].strip() == ".venv/bin/serve run serve/config.yaml"


def test_start_and_call_with_curl(env):
    start, calls = blocks()[:2]
    port = free_port()
    proc = subprocess.Popen(["bash", "-c", "exec " + start.strip().replace("8000", str(port))], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        out = _shell(calls.replace("8000", str(port)), env)
    finally:
        _stop(proc)
    assert out[0].startswith('{"status":"ok","tools":[')
    assert {"crop", "sharpen", "super_resolution", "perspective_correct", "ocr"} <= set(out[1].split())
    assert out[2] == out[3] == "ok Cropped img_1 to 200x120 as img_2. img_2"  # JSON, then multipart (curl -F)
    assert out[4] == "422"


def test_token_backend_options_and_official_edsr_layout(env, tmp_path):
    import torch

    from osvl.tools.super_resolution import build_model

    model = build_model(num_feat=64, num_block=16, upscale=4, bicubic_skip=False)  # EDSR-M x4
    weights = tmp_path / "EDSR_Mx4_official.pth"
    torch.save({"params": model.edsr.state_dict()}, weights)
    start, calls = blocks()[2:4]
    port = free_port()
    cmd = start.strip().replace("8000", str(port)).replace(OFFICIAL, str(weights))
    proc = subprocess.Popen(["bash", "-c", "exec env " + cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        out = _shell(calls.replace("8000", str(port)), env)
    finally:
        _stop(proc)
    assert out == ["401", "Upscaled img_1 x4 to 256x256 as img_2."]


def test_serve_run_with_the_config_file(env, tmp_path):
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text((REPO / "serve" / "config.yaml").read_text().replace("port: 8000", f"port: {port}"))
    cmd = blocks()[4].strip().replace("serve/config.yaml", str(cfg))
    proc = subprocess.Popen(["bash", "-c", "exec " + cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/tools", timeout=30) as resp:
            assert b'"crop"' in resp.read()
    finally:
        _stop(proc)
