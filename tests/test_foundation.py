"""Package hygiene and the loopback-only Ray cluster."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest
import ray

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


def cluster_listening_sockets(session_dir: str) -> list[tuple[str, str]]:
    """(process name, bound ip) of every listening socket of one Ray cluster's processes.

    A cluster's processes are found by its session directory on their command line,
    plus all their descendants (workers, actors, agents) and this driver.
    """
    import psutil

    pids = {os.getpid()}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if session_dir in " ".join(proc.info["cmdline"] or []):
                pids.add(proc.pid)
                pids.update(c.pid for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((psutil.Process(c.pid).name(), c.laddr.ip))
    return out


@pytest.mark.slow
def test_ray_cluster_listens_on_loopback_only(ray_cluster):
    # ray is imported at this module's top, before the cluster starts: the trap
    # osvl.cluster.init_ray must defuse.
    @ray.remote
    class Echo:
        def pid(self) -> int:
            return os.getpid()

    actor = Echo.remote()
    assert ray.get(actor.pid.remote()) > 0
    sockets = cluster_listening_sockets(ray_cluster.address_info["session_dir"])
    names = {name for name, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, names
    exposed = [(name, ip) for name, ip in sockets if not _is_loopback(ip)]
    assert not exposed, f"Ray sockets not on loopback: {exposed}"
