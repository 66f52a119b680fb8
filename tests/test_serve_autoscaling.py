"""EDSR's GPU autoscaling exercised: serve/config.gpu.yaml's replica options on a cluster with logical GPUs.

The child process starts its own loopback cluster: a head with nothing to give, a *tools* node (the ``tools``
resource and 2 logical GPUs) and a node with 2 free logical GPUs but no ``tools`` resource, as a learner node of
the GRPO cluster would be. It deploys the tool app with only ``super_resolution``, its replica options exactly
as serve/config.gpu.yaml has them (a whole GPU, the tools resource, 1 to 2 replicas), the autoscaler's delays
and target shortened so the test takes seconds, and drives it at about 4x the target load with concurrent HTTP
calls (a bounded number, from 8 threads). Logical GPUs: Ray places by them as by real ones; EDSR then runs on
CPU (``edsr_device`` finds no CUDA), which changes the speed, not the placement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TARGET = 2           # target ongoing requests per replica (the test's; production: 32)
CLIENTS = 8          # concurrent callers: about 4x the target of one replica
UP_WITHIN_S = 30.0
DOWN_WITHIN_S = 60.0


@pytest.mark.slow
def test_edsr_scales_out_on_tools_nodes_only_and_back():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="osvl-as-", dir="/tmp") as tmp:  # short: Ray's socket paths
        env["RAY_TMPDIR"] = tmp
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # serve/ for driver and replicas
        done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    lines = [json.loads(x.removeprefix("RESULT ")) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    got = lines[0]
    print(json.dumps(got))
    assert got["up_s"] is not None and got["up_s"] <= UP_WITHIN_S, got       # 1 -> 2 under load
    assert got["max_replicas_seen"] <= got["max_replicas"] == 2, got         # never above the maximum
    assert got["replica_nodes"] and set(got["replica_nodes"]) <= {got["tools_node"]}, got  # tools node only
    assert got["down_s"] is not None and got["down_s"] <= DOWN_WITHIN_S, got  # back to 1 when the load stops
    assert got["errors"] == 0 and got["calls"] > 0, got


def _child() -> None:
    """A 3-node cluster, the app, the load; one RESULT line of JSON."""
    import threading
    import urllib.request

    import numpy as np
    import yaml

    from osvl.cluster import LOOPBACK, free_port, loopback_env, worker_env

    dash = free_port()
    os.environ.update({**loopback_env(), **worker_env(f"http://{LOOPBACK}:{dash}")})
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from osvl.cluster import start_serve
    from osvl.config import from_dict
    from osvl.tools.client import encode_image
    from osvl.tools.registry import all_tools
    from serve.app import APP_NAME, ServeConfig, make_app

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "num_gpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": True,
        "dashboard_host": LOOPBACK, "dashboard_port": dash})
    try:
        tools_node = cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address=LOOPBACK, resources={"tools": 1})
        other = cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address=LOOPBACK)
        ray.init(address=cluster.address)
        port = start_serve()
        app = yaml.safe_load((REPO / "serve" / "config.gpu.yaml").read_text())["applications"][0]
        sr = next(d for d in app["deployments"] if d["name"] == "tool_super_resolution")
        options = {k: v for k, v in sr.items() if k != "name"}
        options["max_ongoing_requests"] = 4 * TARGET
        options["autoscaling_config"] = {**options["autoscaling_config"], "target_ongoing_requests": TARGET,
                                         "upscale_delay_s": 1.0, "downscale_delay_s": 4.0,
                                         "metrics_interval_s": 0.5, "look_back_period_s": 2.0}
        cfg = from_dict(ServeConfig, {**app["args"], "tools": ["super_resolution"], "max_batch_size": 2})
        serve.run(make_app(all_tools(), cfg, {"tool_super_resolution": options}), name=APP_NAME, route_prefix="/")

        def replicas() -> list[str]:
            actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            return [a.node_id for a in actors if a.class_name.endswith(f"{APP_NAME}:tool_super_resolution")]

        pic = encode_image(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8))
        body = json.dumps({"arguments": {"image": "img_1"}, "images": {"img_1": pic}}).encode()
        url = f"http://{LOOPBACK}:{port}/v1/tools/super_resolution"
        stop, stats = threading.Event(), {"calls": 0, "errors": 0}

        def client() -> None:
            deadline = time.monotonic() + UP_WITHIN_S + 10  # bounded in time whatever happens
            while not stop.is_set() and time.monotonic() < deadline:
                req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        ok = json.loads(r.read())["status"] == "ok"
                except Exception:  # noqa: BLE001 - counted, reported
                    ok = False
                stats["calls"] += 1
                stats["errors"] += not ok

        seen: set[str] = set(replicas())
        most = len(seen)
        threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        up = None
        while time.monotonic() - t0 < UP_WITHIN_S + 5:
            now = replicas()
            seen.update(now)
            most = max(most, len(now))
            if len(now) >= 2 and up is None:
                up = time.monotonic() - t0
                time.sleep(3)  # keep the load a little longer: the maximum must hold under it
                seen.update(replicas())
                most = max(most, len(replicas()))
                break
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=70)
        t1, down = time.monotonic(), None
        while time.monotonic() - t1 < DOWN_WITHIN_S + 10:
            now = replicas()
            seen.update(now)
            most = max(most, len(now))
            if len(now) == 1:
                down = time.monotonic() - t1
                break
            time.sleep(0.5)
        print("RESULT " + json.dumps({
            "up_s": up, "down_s": down, "max_replicas_seen": most,
            "max_replicas": options["autoscaling_config"]["max_replicas"], "replica_nodes": sorted(seen),
            "tools_node": tools_node.node_id, "other_node": other.node_id, **stats}), flush=True)
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _child()
