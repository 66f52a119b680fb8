"""Package hygiene and the loopback-only Ray cluster."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest

HEAVY = ("ray", "torch", "transformers", "deepspeed")


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_import_osvl_is_light():
    code = (
        "import sys, osvl, osvl.config, osvl.errors, osvl.cluster\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import osvl pulled in heavy modules: {out.stdout}"


@pytest.mark.slow
def test_ray_cluster_listens_on_loopback_only(ray_cluster):
    import psutil
    import ray

    @ray.remote
    def ping() -> int:
        return 1

    assert ray.get(ping.remote()) == 1
    ray_pids = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(k in cmd for k in ("gcs_server", "raylet", "ray::", "dashboard", "ray/_private",
                                  "log_monitor", "monitor.py", "runtime_env")):
            ray_pids.add(proc.info["pid"])
    assert ray_pids, "found no Ray processes"
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ray_pids]
    assert listening, "Ray processes listen on no socket?"
    exposed = [(c.pid, c.laddr) for c in listening if not _is_loopback(c.laddr.ip)]
    assert not exposed, f"Ray sockets not on loopback: {exposed}"
