"""The GRPO learner's placement (osvl/rl/placement.py): its 8 workers on one node, the rollout actors elsewhere.

The fast tests check ``learner_strategy`` on node lists and ``start_learner`` on a stand-in trainer.

The slow tests start a 3-node Ray cluster with logical GPUs in a child process: a head with no CPU and
no GPU and two nodes of 8 GPUs, shaped after cluster.yaml's ``learner_gpu`` and ``rollout_gpu`` node
types (with their role resources). A child, because this session may hold a Ray connection of its own;
its Ray state lives under a temp dir of its own (``RAY_TMPDIR``), so it neither joins nor announces a
cluster to anything else on the machine, and every server listens on loopback (``loopback_env``).
There the production code places the production profile's learner (``make_learner``, ``start_learner``:
only the train function is a probe, and the collective backend is none, since no CUDA is here and
placement does not depend on it) and then its rollout actors (``rollout_actor_class`` with a probe
class), in trainer.py's order. Two rounds: without role units (only the strategy and the order keep the
learner together: actors first and PACK, the old order, split it 6 + 2 on this cluster), then with the
profile's role units.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from osvl.rl.placement import LearnerRun, learner_strategy, node_capacity, start_learner

REPO = Path(__file__).resolve().parents[1]


def _node(gpus: float, alive: bool = True, **res: float) -> dict:
    return {"Alive": alive, "Resources": {"CPU": 96.0, "GPU": gpus, **res}}


# ---------------------------------------------------------------------------------------------- fast

def test_learner_strategy_strict_pack_when_one_node_holds_every_gpu():
    two_nodes = [_node(0, CPU=0), _node(8), _node(8)]
    assert learner_strategy(8, True, two_nodes) == "STRICT_PACK"
    assert learner_strategy(4, True, two_nodes) == "STRICT_PACK"
    assert learner_strategy(16, True, two_nodes) == "PACK"  # larger than any node: as few nodes as needed
    assert learner_strategy(8, True, [_node(4), _node(4)]) == "PACK"  # 8 GPUs in all, on no single node
    assert learner_strategy(8, True, [_node(8, alive=False), _node(4)]) == "PACK"  # a dead node holds nothing
    assert learner_strategy(8, True, []) == "PACK"  # autoscaler, no GPU node up yet: a group that can be created
    assert learner_strategy(8, False, two_nodes) == "PACK"  # CPU workers: nothing to keep together
    assert learner_strategy(1, False, []) == "PACK"


def test_learner_strategy_counts_every_resource_of_the_bundle():
    bundle = {"CPU": 8.0, "GPU": 1.0, "learner": 1.0}
    roles = [_node(8, rollout=8), _node(8, learner=8)]
    assert learner_strategy(8, True, roles, bundle) == "STRICT_PACK"
    assert learner_strategy(8, True, [_node(8, rollout=8), _node(8, learner=4)], bundle) == "PACK"
    assert learner_strategy(8, True, [_node(8, learner=8, CPU=32)], bundle) == "PACK"  # 8 x 8 CPUs do not fit
    assert node_capacity(_node(8, learner=8), bundle) == 8 and node_capacity(_node(8), bundle) == 0
    assert node_capacity(_node(8), {"GPU": 0.5}) == 16


class _Trainer:
    """A stand-in for a TorchTrainer: ``fit`` runs ``body``."""

    def __init__(self, body, num_workers: int = 2, resources: dict | None = None) -> None:
        self.body = body
        self.scaling_config = SimpleNamespace(num_workers=num_workers, placement_strategy="STRICT_PACK",
                                              resources_per_worker=resources or {"CPU": 1.0, "GPU": 1.0})

    def fit(self):
        return self.body()


def _group(pg_id: str, n: int, state: str = "CREATED", unit: dict | None = None) -> dict:
    return {"placement_group_id": pg_id, "state": state, "bundles": {i: unit or {"CPU": 1.0, "GPU": 1.0}
                                                                      for i in range(n)},
            "bundles_to_node_id": {i: f"node-{pg_id}" for i in range(n)}}


@pytest.fixture
def table(monkeypatch):
    """``ray.util.placement_group_table`` as a dict the test fills in."""
    import ray
    import ray.util

    groups: dict[str, dict] = {"old": _group("old", 2)}  # a group of an earlier run: never the learner's
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: dict(groups))
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 4.0, "GPU": 1.0, "node:127.0.0.1": 1.0})
    return groups


def test_start_learner_returns_once_the_new_group_is_created_and_join_gives_fits_result(table):
    release = threading.Event()

    def fit():
        table["other"] = _group("other", 3)  # not the learner's shape
        table["wrong"] = _group("wrong", 2, unit={"CPU": 1.0})  # not its bundle
        time.sleep(0.3)
        table["pending"] = _group("pending", 2, state="PENDING")
        time.sleep(0.3)
        table["pending"] = _group("pending", 2)
        release.wait(10)
        return "result"

    t0 = time.monotonic()
    run = start_learner(_Trainer(fit), timeout_s=10, poll_s=0.05)
    assert 0.5 < time.monotonic() - t0 < 5
    assert run.placement_group_id == "pending" and set(run.bundle_nodes.values()) == {"node-pending"}
    assert run.thread.is_alive()  # returned while fit() goes on
    release.set()
    assert run.join(timeout=10) == "result"


def test_start_learner_raises_fits_error_before_the_group_and_join_raises_it_after(table):
    def fail_early():
        raise RuntimeError("insufficient cluster resources")

    with pytest.raises(RuntimeError, match="insufficient cluster resources"):
        start_learner(_Trainer(fail_early), timeout_s=30, poll_s=0.05)

    def fail_late():
        table["learner"] = _group("learner", 2)
        time.sleep(0.2)
        raise ValueError("worker died")

    run = start_learner(_Trainer(fail_late), timeout_s=30, poll_s=0.05)
    with pytest.raises(ValueError, match="worker died"):
        run.join(timeout=10)


def test_start_learner_times_out_with_what_it_waited_for(table):
    never = threading.Event()
    run_holder: list[LearnerRun] = []
    with pytest.raises(TimeoutError, match=r"learner's 2 workers .* STRICT_PACK\) got no placement group in 0.3 s"
                                           r".*'GPU': 1\.0"):
        run_holder.append(start_learner(_Trainer(never.wait), timeout_s=0.3, poll_s=0.05))
    never.set()


# ---------------------------------------------------------------------------------------------- slow

# the rounds of the child, in order: without role units first (a fresh cluster, nothing placed before), then
# with the production profile's (the nodes declare cluster.yaml's role resources in both rounds: unrequested,
# a custom resource steers nothing)
SCENARIOS = {"no_roles": ["--learner.role_units=0", "--rollout.role_units=0"], "roles": []}


@pytest.fixture(scope="module")
def placements() -> dict[str, dict]:
    """The child's report of each round (see ``_child``), started once for this module's slow tests."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="osvl-pl-", dir="/tmp") as tmp:  # short: Ray's socket paths
        # the child's Ray temp root: its sessions, its sockets and its 'current cluster' file, not /tmp/ray's
        env["RAY_TMPDIR"] = tmp
        done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    rounds = [json.loads(x.removeprefix("RESULT ")) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and len(rounds) == len(SCENARIOS), done.stdout[-3000:] + done.stderr[-6000:]
    return {r["scenario"]: r for r in rounds}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_production_learner_on_one_node_and_rollout_actors_on_the_other(placements, scenario):
    got = placements[scenario]
    nodes = got["nodes"]  # node id -> cluster.yaml node type (head, learner_gpu, rollout_gpu)
    assert got["strategy"] == "STRICT_PACK"
    learner_nodes = set(got["bundle_nodes"])
    assert len(got["bundle_nodes"]) == 8 and len(learner_nodes) == 1, got  # every bundle on one node ...
    assert sorted(map(int, got["rank_nodes"])) == list(range(8)), got
    assert set(got["rank_nodes"].values()) == learner_nodes, got  # ... and every rank on its bundle's node
    (learner_node,) = learner_nodes
    actor_nodes = set(got["actor_nodes"].values())
    assert len(got["actor_nodes"]) == 4 and len(actor_nodes) == 1 and learner_node not in actor_nodes, got
    assert {nodes[learner_node], *(nodes[n] for n in actor_nodes)} == {"learner_gpu", "rollout_gpu"}, got
    if scenario == "roles":  # each role on the node type that declares it
        assert nodes[learner_node] == "learner_gpu" and got["role_units"] == {"learner": 1.0, "rollout": 1.0}, got
    else:
        assert got["role_units"] == {"learner": 0.0, "rollout": 0.0}
    assert got["fit"] == "ok"


@pytest.mark.slow
def test_the_placement_cluster_listens_on_loopback_only(placements):
    """Every listening socket of the child's cluster (GCS, raylets, agents, workers, the Train controller)."""
    sockets = placements["no_roles"]["sockets"]
    assert {"gcs_server", "raylet"} <= {name for name, _ in sockets}, sockets
    assert all(_is_loopback(ip) for _, ip in sockets), [s for s in sockets if not _is_loopback(s[1])]


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _child() -> None:
    """The slow tests' child process: a 3-node cluster; per round of ``SCENARIOS`` the production placement
    code (``make_learner``, ``start_learner``, ``rollout_actor_class``, in trainer.py's order); a JSON line
    per round."""
    from osvl.cluster import LOOPBACK, free_port, loopback_env, worker_env

    dash = free_port()
    os.environ.update({**loopback_env(), **worker_env(f"http://{LOOPBACK}:{dash}")})
    import ray
    import ray.train.torch
    from ray.cluster_utils import Cluster
    from ray.train.backend import BackendConfig

    from osvl.rl.plan import read_cluster

    class NoCollectives(BackendConfig):
        """No process group: there is no CUDA (NCCL) here, and placement does not depend on it."""

        def __init__(self, backend: str | None = None) -> None:
            self.backend = backend

    ray.train.torch.TorchConfig = NoCollectives  # what make_trainer builds its backend from
    types = {n.name: n for n in read_cluster(REPO / "cluster.yaml")}
    cluster = Cluster(initialize_head=True, head_node_args={  # the head: no CPU, no GPU (cluster.yaml's)
        "num_cpus": 0, "num_gpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": True,
        "dashboard_host": LOOPBACK, "dashboard_port": dash})
    try:
        names = {cluster.head_node.node_id: "head"}
        for name in ("rollout_gpu", "learner_gpu"):  # the rollout node first: no luck of the draw for the learner
            t = types[name]
            node = cluster.add_node(num_cpus=int(t.cpus), num_gpus=t.gpus, node_ip_address=LOOPBACK,
                                    resources=t.resources)
            names[node.node_id] = name
        ray.init(address=cluster.address)
        for i, scenario in enumerate(SCENARIOS):
            t0 = time.monotonic()
            got = _round(scenario, sockets=i == 0)
            print("RESULT " + json.dumps({"scenario": scenario, "nodes": names, "seconds": time.monotonic() - t0,
                                          **got}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _round(scenario: str, sockets: bool) -> dict:
    """The production profile's learner and rollout actors placed by the production code, then released."""
    import psutil
    import ray

    from osvl.cluster import ROLE_RESOURCES
    from osvl.config import parse_args
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB
    from osvl.rl.placement import make_learner, rollout_actor_class, start_learner

    cfg = parse_args(GRPOJobConfig, JOB, ["--profile=production", "--rollout.python=", *SCENARIOS[scenario]])
    lc, rc = cfg.learner, cfg.rollout

    @ray.remote(num_cpus=0)
    class Board:
        """Where the learner's ranks say where they run, and wait until the actors are placed."""

        def __init__(self) -> None:
            self.ranks: dict[int, str] = {}
            self.go = False

        def put(self, rank: int, node: str) -> None:
            self.ranks[rank] = node

        def get(self) -> dict[int, str]:
            return self.ranks

        def release(self) -> None:
            self.go = True

        def released(self) -> bool:
            return self.go

    def probe_loop(config: dict) -> None:
        import time as t

        import ray as r
        import ray.train as rt

        board = config["board"]
        r.get(board.put.remote(rt.get_context().get_world_rank(), r.get_runtime_context().get_node_id()))
        while not r.get(board.released.remote()):  # hold the GPUs, as the learner does in buffer.take
            t.sleep(0.2)

    class Probe:
        def __init__(self, *args) -> None:
            pass

        def node(self) -> str:
            import ray as r

            return r.get_runtime_context().get_node_id()

    board = Board.remote()
    with tempfile.TemporaryDirectory() as store:
        trainer = make_learner(probe_loop, {"board": board}, lc, store)
        run = start_learner(trainer, timeout_s=120)
        actors = [rollout_actor_class(Probe, rc, name=f"{scenario}-rollout{i}").remote(i)
                  for i in range(rc.workers)]
        actor_nodes = {f"rollout{i}": ray.get(a.node.remote(), timeout=60) for i, a in enumerate(actors)}
        deadline = time.monotonic() + 60
        while len(ranks := ray.get(board.get.remote())) < lc.workers and time.monotonic() < deadline:
            time.sleep(0.2)
        listening = _listening(psutil, os.environ["RAY_TMPDIR"]) if sockets else []
        ray.get(board.release.remote())
        run.join(timeout=120)
    for a in [*actors, board]:
        ray.kill(a)
    deadline = time.monotonic() + 60  # the next round starts on free GPUs
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources()["GPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"strategy": trainer.scaling_config.placement_strategy, "bundle_nodes": list(run.bundle_nodes.values()),
            "rank_nodes": ranks, "actor_nodes": actor_nodes, "fit": "ok", "sockets": listening,
            "role_units": {ROLE_RESOURCES["learner"]: lc.role_units, ROLE_RESOURCES["rollout"]: rc.role_units}}


def _listening(psutil, root: str) -> list[tuple[str, str]]:
    """(process name, address) of every listening socket of the cluster under ``root`` (its processes name the
    temp dir on their command line; their children are the workers) and of this driver."""
    pids = {os.getpid()}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if root in " ".join(proc.info["cmdline"] or []):
                pids.add(proc.pid)
                pids.update(c.pid for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return [(psutil.Process(c.pid).name(), c.laddr.ip) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


if __name__ == "__main__":
    _child()
