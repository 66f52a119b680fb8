"""Load and failure behaviour of the tool API: sustained concurrency, and a replica killed mid-load.

One Serve app (sharpen only, two fixed replicas so one can die while the other answers) is shared
by the module. Images are small (64x64) because the two CPU cores of CI are shared by the
clients, the proxy, the ingress and the replicas (the kill test uses a slower call on purpose).
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from osvl.tools.client import HttpTransport, ToolClient

pytestmark = pytest.mark.slow

APP = "osvl_tools_load"


@pytest.fixture(scope="module")
def api(ray_cluster):
    from ray import serve

    from osvl.cluster import start_serve
    from osvl.tools.registry import all_tools
    from serve.app import ServeConfig, make_app

    port = start_serve()
    fixed = {"num_replicas": 2, "autoscaling_config": None}
    # inline=[]: every call crosses the ingress -> tool replica hop, the one a replica kill interrupts
    app = make_app(all_tools(), ServeConfig(tools=["sharpen"], inline=[]), {"tool_sharpen": fixed, "api": fixed})
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


async def _load(api: str, clients: int, seconds: float, during=None, size: int = 64, sigma: float = 1.0
                ) -> tuple[list[float], list[str], dict]:
    """``clients`` coroutines, each with its own HTTP client, calling sharpen back to back for ``seconds``."""
    ramp = np.linspace(0, 255, size)  # smooth, so PNG coding stays cheap next to the blur itself
    img = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) / 2 + 128, np.full((size, size), 90.0)],
                   axis=-1).astype(np.uint8)
    latencies: list[float] = []
    failures: list[str] = []
    stats = {"calls": 0, "attempts": 0, "retries": 0}
    deadline = time.monotonic() + seconds

    async def one_client() -> None:
        async with ToolClient(HttpTransport(api), timeout_s=30, retries=4, backoff_s=0.2) as client:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                r = await client.call("sharpen", {"image": "img_1", "sigma": sigma}, {"img_1": img})
                latencies.append(time.perf_counter() - t)
                if not r.ok or r.images["img_2"].shape != img.shape:
                    failures.append(r.text)
            for k in stats:
                stats[k] += client.stats[k]

    tasks = [asyncio.create_task(one_client()) for _ in range(clients)]
    if during is not None:
        await during()
    await asyncio.gather(*tasks)
    return latencies, failures, stats


def _summary(name: str, latencies: list[float], seconds: float, stats: dict) -> dict:
    q = np.percentile(np.array(latencies) * 1000, [50, 99])
    out = {"test": name, "requests": len(latencies), "rps": round(len(latencies) / seconds, 1),
           "p50_ms": round(float(q[0]), 1), "p99_ms": round(float(q[1]), 1), **stats}
    print(json.dumps(out))
    return out


def test_32_clients_for_60_seconds_without_errors(api):
    latencies, failures, stats = asyncio.run(_load(api, clients=32, seconds=60))
    summary = _summary("load_32x60s", latencies, 60, stats)
    assert not failures, failures[:5]
    assert summary["requests"] >= 32 * 10  # every client made progress, not just a few


def _replicas(name: str) -> dict[str, int]:
    from ray import serve

    dep = serve.status().applications[APP].deployments[name]
    return {str(k): v for k, v in dep.replica_states.items()}


def test_a_replica_killed_under_load_is_retried_and_replaced(api):
    import ray

    assert _replicas("tool_sharpen").get("RUNNING") == 2
    prefix = f"SERVE_REPLICA::{APP}#tool_sharpen#"
    victims = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(victims) == 2

    async def kill_one() -> None:
        await asyncio.sleep(4)  # the load is running: every replica has requests in flight
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)

    # a slow call (512x512, sigma 40: a 321-tap blur) keeps both replicas full (8 calls each), so the kill
    # lands on calls in flight; with cheap calls most of the time is spent in HTTP and the kill may hit none
    latencies, failures, stats = asyncio.run(_load(api, clients=16, seconds=15, during=kill_one, size=512,
                                                   sigma=40))
    _summary("kill_replica", latencies, 15, stats)
    assert not failures, failures[:5]
    assert stats["retries"] >= 1  # the in-flight calls on the dead replica came back unavailable and were retried
    deadline = time.monotonic() + 120
    while _replicas("tool_sharpen").get("RUNNING") != 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert _replicas("tool_sharpen").get("RUNNING") == 2
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert victims[0] not in names and len(names) == 2
