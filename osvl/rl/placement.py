"""Where the GRPO learner's workers go, and why the launcher reserves their GPUs before the rollout actors'.

The learner is one DeepSpeed job over ``learner.workers`` GPUs: every step all-gathers
parameters and reduce-scatters gradients between all its ranks (ZeRO-3), so ranks on two nodes
talk over the network instead of NVLink, and a step is as slow as its slowest link. Ray Train
reserves the workers as one placement group of ``learner.workers`` bundles; two things decide
whether that group lands on one node:

- its strategy. ``PACK`` is best effort: when no single node has room at the moment the group is
  created, Ray splits it over nodes without a word. ``STRICT_PACK`` refuses to split; it waits
  for a node with room instead. ``learner_strategy`` asks for ``STRICT_PACK`` whenever some alive
  node could hold the whole group, and ``PACK`` (the fewest nodes the GPUs need) when none can
  (a learner larger than a node, or an autoscaled cluster whose GPU nodes are not up yet: a
  ``STRICT_PACK`` group no node can hold would wait forever).
- what was reserved before it. The rollout actors ask for ``SPREAD`` (losing a node loses the
  fewest of them) and one GPU each: started first, they take GPUs on every GPU node, and no node
  keeps all of its GPUs for the learner. So the launcher starts the learner first
  (``start_learner``: ``fit()`` runs in a thread, the call returns once the learner's placement
  group is CREATED) and only then creates the actors, which SPREAD over what is left.

Role resources (``learner.role_units`` / ``rollout.role_units``, ``osvl.cluster.ROLE_RESOURCES``)
keep each role on the nodes that declare it, whatever the order; the order and the strategy keep
the learner on one node on a cluster whose nodes declare no roles (a single GPU pool).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osvl.cluster import role_resources
from osvl.train.deepspeed import make_trainer, worker_bundle

if TYPE_CHECKING:
    from osvl.rl.trainer import LearnerConfig

PLACEMENT_TIMEOUT_S = 1800.0
"""How long ``start_learner`` waits for the learner's GPUs: an autoscaler may first have to launch a GPU
node and pull the image (minutes), but a group that no node will ever hold must not wait silently."""


def node_capacity(node: Mapping[str, Any], bundle: Mapping[str, float]) -> int:
    """How many ``bundle``s fit in ``node``'s total resources (a ``ray.nodes()`` entry); dead nodes hold none."""
    if not node.get("Alive", True):
        return 0
    total = node.get("Resources") or {}
    need = {k: v for k, v in bundle.items() if v > 0}
    if not need:
        return 0
    return min(math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in need.items())


def learner_strategy(num_workers: int, use_gpu: bool, nodes: Iterable[Mapping[str, Any]] | None = None,
                     bundle: Mapping[str, float] | None = None) -> str:
    """The placement-group strategy of the learner's workers (see the module docstring).

    ``STRICT_PACK`` when the learner's GPUs fit one alive node of ``nodes`` (``ray.nodes()`` when None),
    else ``PACK``: as few nodes as their GPUs need. ``bundle`` is one worker's reservation
    (``osvl.train.deepspeed.worker_bundle``); a node counts only with room for ``num_workers`` of them in
    every resource (GPUs, CPUs, the learner's role resource), so that a ``STRICT_PACK`` group can be
    created at all. Without ``bundle`` only GPUs count. Without GPUs: ``PACK``, ``make_trainer``'s default
    (CPU learners are the demo's and the tests', on one machine: a strict group would only add a way to
    wait).
    """
    if not use_gpu:
        return "PACK"
    if nodes is None:
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        nodes = ray.nodes()
    need = dict(bundle) if bundle else {"GPU": 1.0}
    most = max((node_capacity(n, need) for n in nodes), default=0)
    return "STRICT_PACK" if most >= num_workers else "PACK"


def make_learner(train_fn: Callable[[dict], None], loop_config: dict, lc: LearnerConfig, storage: Path | str,
                 nodes: Iterable[Mapping[str, Any]] | None = None) -> Any:
    """The learner's ``TorchTrainer`` (``osvl.train.deepspeed.make_trainer``) as the launcher builds it: its
    workers' reservation (``worker_bundle``: CPUs, a GPU each, ``learner.role_units`` of the learner role
    resource) and ``learner_strategy`` over the alive ``nodes`` (``ray.nodes()`` when None)."""
    bundle = worker_bundle(lc.threads_per_worker, lc.use_gpu, lc.role_units)
    return make_trainer(train_fn, loop_config, num_workers=lc.workers, threads_per_worker=lc.threads_per_worker,
                        use_gpu=lc.use_gpu, storage=storage, name="ray_train", keep=1, max_failures=lc.max_failures,
                        resources=role_resources("learner", lc.role_units),
                        placement_strategy=learner_strategy(lc.workers, lc.use_gpu, nodes, bundle))


def rollout_actor_class(cls: type, rc: Any, **options: Any) -> Any:
    """``cls`` as a Ray actor class with the rollout actors' options: the role's reservation
    (``RolloutConfig.actor_options``: CPUs, GPUs, the ``rollout`` role resource), its interpreter, no
    Ray restart (the launcher's monitor restarts and re-issues slots), and ``SPREAD`` over the nodes
    the learner left (losing one node loses the fewest actors). ``options``: e.g. ``name``."""
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    return ray.remote(cls).options(scheduling_strategy="SPREAD", max_restarts=0, runtime_env=rc.runtime_env(),
                                   **rc.actor_options(), **options)


class LearnerRun:
    """A learner's ``fit()`` running in a thread of the driver (``start_learner``)."""

    def __init__(self, trainer: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.placement_group_id: str = ""
        self.bundle_nodes: dict[int, str] = {}
        self.thread = threading.Thread(target=self._fit, args=(trainer,), name="learner-fit", daemon=True)

    def _fit(self, trainer: Any) -> None:
        try:
            self.result = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by join()
            self.error = e

    def join(self, timeout: float | None = None) -> Any:
        """Wait for ``fit()``; return its result, or raise what it raised."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the learner's fit() is still running after {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.result


def _learner_group(table: Mapping[str, Any], before: set[str], num_workers: int,
                   bundle: Mapping[str, float]) -> dict[str, Any] | None:
    """The CREATED placement group of ``table`` (``placement_group_table()``) that is the learner's: new since
    ``before``, ``num_workers`` bundles, each reserving ``bundle``."""
    for pg_id, pg in table.items():
        if pg_id in before or pg.get("state") != "CREATED" or len(pg.get("bundles") or {}) != num_workers:
            continue
        if all(math.isclose(float(units.get(k, 0.0)), v) for units in pg["bundles"].values()
               for k, v in bundle.items() if v > 0):
            return pg
    return None


def start_learner(trainer: Any, timeout_s: float = PLACEMENT_TIMEOUT_S, poll_s: float = 0.2) -> LearnerRun:
    """Start ``trainer.fit()`` (a Ray Train ``TorchTrainer``) in a thread; return once its workers' placement
    group is CREATED, so that what the caller starts next (the rollout actors) gets only what the learner
    left. ``run.join()`` then waits for ``fit()`` and raises what it raised.

    Raises what ``fit()`` raised when it fails before its group exists, and ``TimeoutError`` after
    ``timeout_s`` without the group (the trainer keeps trying in its thread; the caller's exit ends it). A
    ``fit()`` that ends without error before its group was seen returns the run as is (no bundle nodes).
    The group is told from others by being new, CREATED, and of ``num_workers`` bundles of the trainer's
    ``resources_per_worker``; Ray Train names none. Ray Train retries a group it could not create in its
    own time (60 s) with a new one: any of them counts.
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help
    from ray.util import placement_group_table  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    scaling = trainer.scaling_config
    num_workers = int(scaling.num_workers)
    bundle = {k: float(v) for k, v in (scaling.resources_per_worker or {}).items()}
    before = set(placement_group_table())
    run = LearnerRun(trainer)
    run.thread.start()
    deadline = time.monotonic() + timeout_s
    while True:
        pg = _learner_group(placement_group_table(), before, num_workers, bundle)
        if pg is not None:
            run.placement_group_id = pg["placement_group_id"]
            run.bundle_nodes = {int(i): n for i, n in (pg.get("bundles_to_node_id") or {}).items()}
            return run
        if not run.thread.is_alive():  # fit() ended before its group was seen: its error, or a run that was over
            if run.error is not None:
                raise run.error
            return run
        if time.monotonic() > deadline:
            free = ray.available_resources()
            raise TimeoutError(
                f"the learner's {num_workers} workers ({bundle} each, placement strategy "
                f"{scaling.placement_strategy}) got no placement group in {timeout_s:g} s; the cluster has "
                f"{ {k: v for k, v in free.items() if not k.startswith('node:')} } free. A STRICT_PACK group "
                "needs one node with room for all of them (learner.workers, the learner nodes' GPUs, "
                "learner.role_units against the nodes' role resources)")
        time.sleep(poll_s)
