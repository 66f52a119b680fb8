"""Shared fixtures: one loopback-only Ray cluster per test session, started lazily."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("OSVL_SHARED_DATA", REPO.parent / "shared" / "data"))


MISSING = "missing input: "


def missing_input(name: str, msg: str) -> NoReturn:
    """Skip a test whose outside input is missing, or fail it where that input is required
    (``OSVL_REQUIRE_<NAME>=1``, which ``.ci/run`` sets): a green CI must not hide a missing input
    behind a skip. The skips of one input fold into one ``-ra`` summary line (the hook below)."""
    if os.environ.get(f"OSVL_REQUIRE_{name}") == "1":
        pytest.fail(f"{msg} (OSVL_REQUIRE_{name}=1 requires it)", pytrace=False)
    pytest.skip(MISSING + msg)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A fixture's skip is reported at each test's own line, so ``-ra`` would list the ~40 tests that
    read the shared data one by one; a missing input's skips get this file's location instead, and
    fold into one line: how many tests, what is missing, where to get it."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and isinstance(rep.longrepr, tuple) and MISSING in str(rep.longrepr[2]):
        rep.longrepr = (os.path.relpath(__file__), missing_input.__code__.co_firstlineno, rep.longrepr[2])


# The modules that take minutes, longest first (a CI log's durations, 2026-12-07: test_readme 322 s down to
# test_learner_placement 60 s, of the suite's 2,860). `make test` runs the suite on two pytest-xdist workers, whole
# modules each, in this order (--dist loadfile --no-loadscope-reorder): started first, they pair up with each other
# and with the short modules, instead of leaving one worker idle beside a five-minute module at the end. A stale list
# costs minutes, never a result.
LONG_MODULES = ["test_readme.py", "test_multinode.py", "test_vllm_jobs.py", "test_sft.py", "test_grpo_faults.py",
                "test_eval.py", "test_synth_pipeline.py", "test_search.py", "test_serve_load.py",
                "test_pretrain_tiny.py", "test_agent_service.py", "test_observability.py", "test_ray_up.py",
                "test_learner_placement.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other modules keep their order


def pytest_terminal_summary(terminalreporter):
    """Where a long test's minutes went: the phases it recorded with ``record_property("seconds", (what,
    seconds))``, printed after the durations table, so a CI log shows them for passing tests too (a passing
    test's own output is not shown)."""
    lines = [f"{sec:7.1f} s  {rep.nodeid}  {what}" for reps in terminalreporter.stats.values() for rep in reps
             for key, (what, sec) in getattr(rep, "user_properties", []) if key == "seconds" and rep.when == "call"]
    if lines:
        terminalreporter.write_sep("=", "phases the slow tests recorded")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The developers' real data sources (``../shared/data`` beside the checkout, or ``$OSVL_SHARED_DATA``)."""
    if not SHARED_DATA.is_dir():
        missing_input("SHARED_DATA", f"shared data folder not found at {SHARED_DATA}: put it at ../shared/data "
                      "beside the checkout or set OSVL_SHARED_DATA (its README lists the public sources)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tesseract() -> str:
    """The tesseract OCR binary (Debian's ``tesseract-ocr``; ``.ci/run`` installs it)."""
    path = shutil.which("tesseract")
    if path is None:
        missing_input("TESSERACT", "tesseract not installed (apt-get install -y tesseract-ocr tesseract-ocr-eng)")
    return path


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that asks for it (starting one costs ~5 s)."""
    from osvl.cluster import init_ray

    ctx = init_ray(num_cpus=4, include_dashboard=False)
    yield ctx
    import ray

    ray.shutdown()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}  # dummy credentials; never the cloud metadata address


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real S3-compatible object store on loopback (moto's server mode) with one bucket, ``osvl-test``.

    Yields ``{"endpoint", "bucket", "env", "recording"}``; ``env`` holds the settings a client needs (endpoint,
    dummy credentials, ``AWS_EC2_METADATA_DISABLED=true``). They are also set in this process's
    environment for the session, so the storage layer and any Ray worker started here inherit them.
    ``recording``: the file moto's request recorder writes to while a test has it on
    (``/moto-api/recorder/start-recording``), one JSON line per request: what a test reads to count requests.
    """
    import subprocess
    import sys
    import time
    import urllib.request

    from osvl.cluster import LOOPBACK, free_port

    # moto[server] is one of the project's dev dependencies (`make setup` installs it): missing, it fails
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if server is None:
        pytest.fail(f"moto_server not found beside {sys.executable}: run `make setup` (moto[server] is a dev "
                    "dependency)", pytrace=False)
    port = free_port()
    recording = tmp_path_factory.mktemp("moto") / "requests.jsonl"
    proc = subprocess.Popen([server, "-H", LOOPBACK, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "MOTO_RECORDER_FILEPATH": str(recording)})
    endpoint = f"http://{LOOPBACK}:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto server did not come up on {endpoint}") from None
            time.sleep(0.3)
    env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/osvl-test", method="PUT"), timeout=10).close()
        yield {"endpoint": endpoint, "bucket": "osvl-test", "env": env, "recording": recording}
    proc.terminate()
    proc.wait(timeout=15)


# The multi-node cluster's worker nodes: logical GPUs and role resources (osvl.cluster.ROLE_RESOURCES),
# so that placement is exercised without CUDA. Both can host rollouts; "b" is the one a test may kill
# (node "a" keeps a spare rollout unit for the actor that replaces b's).
WORKER_NODES = {"a": {"cpus": 3, "gpus": 1, "roles": {"rollout": 2, "learner": 1, "data": 2, "tools": 1}},
                "b": {"cpus": 2, "gpus": 1, "roles": {"rollout": 1, "data": 2}}}


def loopback_only_namespace() -> bool:
    """True when this process's network namespace has no interface but loopback (tests/netns.sh)."""
    import socket

    return [name for _, name in socket.if_nameindex()] == ["lo"]  # not /sys/class/net: sysfs shows its mounter's


def _state_lister(address: str) -> Callable[..., list[Any]]:
    """``state(resource, detail=False)``: ``ray.util.state.list_<resource>`` of the token-auth multi-node cluster,
    one client that sends the token itself: Ray reads RAY_AUTH_MODE once per process, at the first ``import ray``,
    which in a whole-suite run another module has done by collection time (test_foundation), so the fixture's
    RAY_AUTH_MODE=token came too late for list_nodes & co."""
    from ray._raylet import AuthenticationTokenLoader
    from ray.util.state import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # `ray start --head` wrote the token after this process may first have looked
    client = StateApiClient(address, headers={"Authorization": f"Bearer {loader.get_raw_token(ignore_auth_mode=True)}"})

    def state(resource: str, detail: bool = False) -> list[Any]:
        return client.list(StateResource[resource.upper()], options=ListApiOptions(detail=detail, limit=10_000),
                           raise_on_missing_output=False)

    return state


# module scope: under pytest-xdist the worker goes on to other modules, which must not run beside a three-node
# cluster they never asked for (its processes, its memory)
@pytest.fixture(scope="module")
def multinode_cluster(s3_store):
    """A real multi-node Ray cluster on loopback plus the S3-compatible store (``s3_store``).

    A head with ``num_cpus=0`` like production (it runs job drivers and the dashboard), and the
    worker nodes of ``WORKER_NODES`` joined with ``ray start --address``: separate processes, each
    with its own temp dir (so one can be stopped alone, never with a machine-wide ``ray stop``) and
    its own ``OSVL_STORAGE_CACHE`` (so nothing passes between nodes except through the bucket).
    Yields ``{"address", "env", "temp_dirs", "caches", "state"}``; ``env`` is what a ``ray job submit``
    against it needs, ``state("nodes" | "actors" | "tasks", detail=False)`` lists its state.
    """
    import json
    import subprocess
    import sys
    import tempfile
    import time

    from osvl.cluster import LOOPBACK, ROLE_RESOURCES, free_port, loopback_env, stop_node, worker_env

    if not loopback_only_namespace():
        msg = ("the multi-node cluster's Ray processes listen on every interface (see tests/netns.sh): run these "
               "tests in a private network namespace, as `make test` does (tests/netns.sh pytest ...)")
        missing_input("NETNS", msg)

    # short: Ray's unix sockets live under the temp dir, and a socket path is at most 107 bytes
    base = Path(tempfile.mkdtemp(prefix="osvl-mn-"))
    bin_dir = Path(sys.executable).parent
    dash, gcs = free_port(), free_port()
    address = f"http://{LOOPBACK}:{dash}"
    env = {**os.environ, **loopback_env(), **s3_store["env"], **worker_env(address), "RAY_AUTH_MODE": "token",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
             "--metrics-export-port", "--node-manager-port", "--object-manager-port"]
    temp_dirs = {name: base / f"node-{name}" for name in ["head", *WORKER_NODES]}
    caches = {name: base / f"{name}-cache" for name in temp_dirs}

    def start(name: str, ip: str, args: list[str]) -> None:
        # A worker node must be allowed to join (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1), and with that Ray
        # replaces 127.0.0.1 (in --node-ip-address and --address) by the machine's address: so every node
        # gets a loopback address of its own (127.0.0.2, ...), like distinct hosts, all on `lo`; only the
        # dashboard (job submission, state API) is on 127.0.0.1.
        node_env = {**env, "OSVL_STORAGE_CACHE": str(caches[name]), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        for _ in range(2):  # a free port can be taken by a parallel session before Ray binds it
            cmd = [str(bin_dir / "ray"), "start", f"--node-ip-address={ip}", f"--temp-dir={temp_dirs[name]}",
                   "--disable-usage-stats", *(f"{p}={free_port()}" for p in ports), *args]
            done = subprocess.run(cmd, env=node_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=300)
            if done.returncode == 0:
                return
            stop_node(str(temp_dirs[name]))
        raise RuntimeError(f"ray start of node {name} failed: {done.stderr[-3000:]}")

    try:
        start("head", "127.0.0.2", ["--head", "--num-cpus=0", "--num-gpus=0", f"--port={gcs}",
                                 f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dash}",
                                 f"--ray-client-server-port={free_port()}"])
        for i, (name, node) in enumerate(WORKER_NODES.items()):
            roles = {ROLE_RESOURCES[role]: units for role, units in node["roles"].items()}
            start(name, f"127.0.0.{i + 3}", [f"--address=127.0.0.2:{gcs}", f"--num-cpus={node['cpus']}",
                                             f"--num-gpus={node['gpus']}", f"--resources={json.dumps(roles)}"])
        # RAY_AUTH_MODE=token lives in `env` (every CLI call) and in state()'s header, never in this process:
        # Ray would read it only at the first import, which another module may have done already
        state = _state_lister(address)
        deadline = time.time() + 120
        while len([n for n in state("nodes") if n.state == "ALIVE"]) < 1 + len(WORKER_NODES):
            if time.time() > deadline:
                raise RuntimeError("the worker nodes did not join")
            time.sleep(1)
        yield {"address": address, "env": env, "temp_dirs": temp_dirs, "caches": caches, "state": state}
    finally:
        for name in reversed(list(temp_dirs)):
            stop_node(str(temp_dirs[name]))
        shutil.rmtree(base, ignore_errors=True)
