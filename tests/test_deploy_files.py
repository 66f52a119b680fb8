"""The cluster launcher config and KubeRay manifests are valid for the tools that read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_cluster_yaml_matches_ray_autoscaler_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    jsonschema.validate(cfg, schema)
    assert cfg["head_node_type"] in cfg["available_node_types"]
    # every role the jobs schedule on has a node type that offers it
    offered = {r for t in cfg["available_node_types"].values() for r in t.get("resources", {})}
    assert {"learner", "rollout", "tools", "data"} <= offered
    starts = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in starts


def test_kuberay_manifests_parse():
    docs = []
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "RayJob", "RayService"} <= kinds
    for d in docs:
        assert d["apiVersion"].startswith("ray.io/"), d["apiVersion"]


_BUILD = """
import sys
from serve.app import build_app
from osvl.errors import ConfigError
try:
    app = build_app({"tools": ["crop"]})
except ConfigError as e:
    print(e)
    sys.exit(2)
print("built", type(app).__name__)
"""


@pytest.mark.slow  # two fresh interpreters importing Ray Serve (~4 s each)
def test_tool_api_refuses_a_non_loopback_host_without_token():
    """Serve's proxy on 0.0.0.0 (what a RayService runs): no token, one clear line; with a token, the app builds.

    Nothing binds here: the builder reads the host Serve would use and refuses before any deployment.
    """
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OSVL_TOOLS_TOKEN"}
    env.update(RAY_SERVE_DEFAULT_HTTP_HOST="0.0.0.0", PYTHONPATH=str(REPO))
    refused = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stdout.strip()
    assert "\n" not in line and line.startswith("refusing to serve the tool API on 0.0.0.0 without a bearer token")
    assert "OSVL_TOOLS_TOKEN" in line
    env["OSVL_TOOLS_TOKEN"] = "s3cret"
    built = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0 and built.stdout.strip().startswith("built"), built.stderr[-2000:]


def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run bench/gpu_check.sh itself")
    proc = subprocess.run([str(REPO / "bench" / "gpu_check.sh")], env={**__import__("os").environ,
                          "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"gpu_check: skipped: no CUDA GPU visible to {sys.executable} "
                                   "(torch.cuda.is_available() is False)")
