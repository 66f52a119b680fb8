"""The GRPO launcher: wires the buffer, the weight store, the rollout actors and the learner.

    driver ── TrajectoryBuffer (actor) ◄── RolloutWorker x N (actors: engine + agent loop)
       │            │ take(step)                 ▲ weights (WeightStore, versioned)
       └── Ray Train workers (learner, DeepSpeed) ┘

Order matters for resume: the latest checkpoint is read first, the buffer is
rebuilt from it (data cursor, ledger, ready groups; slots in flight re-issued), and
only then do rollout actors start asking for work; the learner loads its model and
Adam state from the same checkpoint and publishes its version before it waits for
a batch, so no actor generates with weights older than the gate allows. The learner's workers reserve
their GPUs before any rollout actor is created (``osvl.rl.placement``): the actors SPREAD over what the
learner leaves, so its ranks share one node whenever one node can hold them.

A monitor thread in the driver watches the actors' ``run`` tasks while the learner
trains: a dead actor's slots go back to the buffer (``release_actor``) and a
replacement starts. The learner itself is restarted by Ray Train's FailureConfig
and resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pyarrow.parquet as pq

from osvl import storage, tracking
from osvl.cluster import init_ray
from osvl.config import RunConfig, opt
from osvl.errors import ConfigError
from osvl.metrics import ROLLOUT_ACTORS_LIVE, ROLLOUT_RESTARTS, Recorder
from osvl.rl import checkpoint as ckpt
from osvl.rl.buffer import TrajectoryBuffer
from osvl.rl.learner import RLConfig
from osvl.rl.learner_loop import LoopSettings, train_loop
from osvl.rl.placement import make_learner, rollout_actor_class, start_learner
from osvl.rl.rollout import RolloutConfig, RolloutWorker
from osvl.rl.weights import WeightStore, check_transport
from osvl.storage import publish
from osvl.train.rehearsal import Rehearsal

logger = logging.getLogger(__name__)


@dataclass
class LearnerConfig:
    """The learner's Ray Train workers."""
    RENAMED: ClassVar[dict[str, str]] = {"num_workers": "workers"}


    workers: int = opt(1, "Ray Train learner workers (data parallel over whole groups).", hashed=False)
    role_units: float = opt(0.0, "Units of the 'learner' custom resource (osvl.cluster.ROLE_RESOURCES, declared on "
                                 "learner nodes by cluster.yaml and deploy/) each learner worker requests; 0 = none.",
                            hashed=False)
    threads_per_worker: int = opt(1, "CPUs (and torch threads) per learner worker.", hashed=False)
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (0-3).", hashed=False)
    use_gpu: bool = opt(False, "Learner workers on GPUs (NCCL, one GPU each).", hashed=False)
    bf16: bool | None = opt(None, "bf16 weights and activations with fp32 master weights and Adam moments "
                                  "(DeepSpeed bf16); None = on with GPUs, off (fp32) on CPU.")
    grad_checkpointing: bool = opt(True, "Recompute each decoder layer's activations in backward: a step's "
                                         "activation memory is one layer's, not every layer's.", hashed=False)
    rehearsal: Rehearsal = opt("off", "Run the learner under the GPU rehearsal on CPU (osvl/train/rehearsal.py): "
                                      "every model input and every collective of osvl code must have gone "
                                      "through the placement helpers, and each rank's peak host memory is "
                                      "recorded; the plant_* values are the rehearsal's self-test.", hashed=False)
    max_failures: int = opt(1, "Ray Train restarts of a failed learner worker group (resumes from the checkpoint).",
                            hashed=False)
    weights: Literal["collective", "object_store"] = opt(
        "collective", "How versions reach the rollout engines (osvl/rl/weights.py): collective = broadcast over a "
        "group of learner rank 0 and every engine (NCCL on GPUs, gloo on CPU), rebuilt when an engine comes or "
        "goes; object_store = each version put into Ray's object store (the catch-up path either way).",
        hashed=False)
    weights_bucket_mb: float = opt(256.0, "Largest bucket of a streamed version, MiB in the engines' dtype: learner "
                                          "rank 0 holds about two at a time.", hashed=False)
    weights_timeout_s: float = opt(30.0, "How long a weight-group rendezvous or broadcast may wait for a member "
                                         "before the group is rebuilt without it.", hashed=False)
    freeze_vision: bool = opt(False, "Train the language model only: the vision tower stays as loaded (and "
                                     "versions leave it out; the engines load it from the same checkpoint).")


@dataclass
class TrainConfig:
    """What one GRPO run does once the model and the questions exist."""

    steps: int = opt(40, "Learner steps.")
    groups_per_step: int = opt(2, "Groups (questions) per learner step; the batch is groups_per_step x G.")
    max_staleness: int = opt(1, "Max policy-version lag of a trained group's oldest turn (0 = synchronous).")
    resample_flat: int = opt(0, "Times a slot is re-issued with the next question when every sample of its group has "
                                "the same accuracy (all right or all wrong: no answer signal; the k-th such group "
                                "is trained). 0 = train every group, as the paper does (osvl/rl/buffer.py).")
    weights_every: int = opt(1, "Publish weights every this many steps.", hashed=False)
    ckpt_every: int = opt(10, "Checkpoint every this many steps (and at the end).", hashed=False)
    keep: int = opt(2, "Checkpoints kept.", hashed=False)
    max_attempts: int = opt(3, "Issues of one group slot before it is dropped (dead actors).", hashed=False)
    max_actor_restarts: int = opt(5, "Rollout-actor restarts before the run is aborted.", hashed=False)


@dataclass
class GRPOParts:
    """Everything ``train`` needs (the job builds it; tests and the benchmark build smaller ones)."""

    run: RunConfig
    rl: RLConfig
    rollout: RolloutConfig
    learner: LearnerConfig
    train: TrainConfig


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def seed_entity(row: dict[str, Any]) -> str:
    """The pictured (seed) entity a question was walked from: the unit held-out errors cluster by."""
    path = row.get("path") or []
    return str(path[0].get("entity_id", path[0].get("title"))) if path else str(row["id"])


def heldout_questions(path: str | Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` held-out questions, dealt round-robin over seed entities (each seed's in id order).

    Questions of one seed share a picture and most of a neighbourhood, so their scores are not
    independent: the first ``n`` by id alone came from 3 seeds (of 206 questions) on the demo data,
    a Pass@1 of 3 effective samples. Dealing by seed spreads any ``n`` over as many seeds as exist.
    """
    by_seed: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(read_questions(path), key=lambda r: r["id"]):
        by_seed.setdefault(seed_entity(row), []).append(row)
    out: list[dict[str, Any]] = []
    queues = list(by_seed.values())
    while len(out) < n and queues:
        out += [q.pop(0) for q in queues[:n - len(out)]]
        queues = [q for q in queues if q]
    return out


class Monitor(threading.Thread):
    """Driver-side: restart dead rollout actors (their slots re-issued) and print the per-step table."""

    def __init__(self, make_actor: Callable[[str], Any], buffer: Any, actors: dict[str, Any], log_path: Path,
                 print_row: Callable[[dict], None], max_restarts: int, log: Callable[[str], None],
                 recorder: Any) -> None:
        super().__init__(daemon=True)
        self.make_actor, self.buffer, self.actors = make_actor, buffer, actors
        self.runs = {name: a.run.remote() for name, a in actors.items()}
        self.log_path, self.print_row = log_path, print_row
        self.max_restarts, self.log, self.rec = max_restarts, log, recorder
        self.stop = threading.Event()
        self.restarts: list[str] = []
        self.finished: dict[str, dict] = {}
        self._offset = log_path.stat().st_size if log_path.exists() else 0

    def run(self) -> None:
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        while not self.stop.is_set():
            self.rec.set(ROLLOUT_ACTORS_LIVE, len(self.runs))
            self.rec.set(ROLLOUT_RESTARTS, len(self.restarts))
            pending = list(self.runs.values())
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0.5) if pending else ([], [])
            for ref in done:
                name = next(n for n, r in self.runs.items() if r == ref)
                del self.runs[name]
                try:
                    self.finished[name] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    reason = f"rollout actor {name} died: {type(e).__name__}"
                    self.log(f"{reason}: {str(e)[-1500:]}")
                    ray.kill(self.actors[name])  # a task error leaves the actor alive: make it a clean death
                    ray.get(self.buffer.release_actor.remote(name, reason))
                    if len(self.restarts) >= self.max_restarts:
                        ray.get(self.buffer.abort.remote(f"{reason}; {len(self.restarts)} restarts already "
                                                         f"(train.max_actor_restarts): {str(e)[-2000:]}"))
                        continue
                    new = f"{name.split('~')[0]}~{len(self.restarts) + 1}"
                    self.restarts.append(f"{name} -> {new}: {reason}")
                    self.actors[new] = self.make_actor(new)
                    self.runs[new] = self.actors[new].run.remote()
            self.tail()
            if not pending:
                self.stop.wait(0.5)
        self.tail()

    def tail(self) -> None:
        for line in self._new_bytes().decode().splitlines(keepends=True):
            if line.endswith("\n"):
                self._offset += len(line.encode())
                self.print_row(json.loads(line))

    def _new_bytes(self) -> bytes:
        """What the learner appended to the step log since ``_offset``. With a remote run root it is read from
        storage: learner rank 0 may run on another node, whose mirror publishes there after every row (and
        this mirror is not written, so a learner on this node keeps its file)."""
        uri = storage.location(self.log_path)
        if storage.is_remote(uri):
            fs, path = storage.open_root(uri)
            info = fs.get_file_info(path)
            if info.type.name != "File" or info.size <= self._offset:
                return b""
            with fs.open_input_file(path) as f:
                return f.read_at(info.size - self._offset, self._offset)
        if not self.log_path.exists():
            return b""
        with self.log_path.open("rb") as f:
            f.seek(self._offset)
            return f.read()


def start_cluster(rc: RolloutConfig, lc: LearnerConfig) -> None:
    """Join ``$RAY_ADDRESS`` or start a local cluster sized for the run: what the actors and workers
    reserve, plus one for Ray Train's controller (on a 2-core machine the demo asks for 3 logical
    CPUs: the cores are shared, not oversubscribed by much)."""
    need = int(rc.workers * rc.cpus_per_worker + lc.workers * lc.threads_per_worker) + 1
    init_ray(num_cpus=max(need, os.cpu_count() or 1))


def train(parts: GRPOParts, model_dir: str | Path, questions: list[dict[str, Any]], question_image_dir: str | Path,
          out: Path, log: Callable[[str], None] = logger.info, print_row: Callable[[dict], None] | None = None,
          actor_prefix: str = "", *, job: str) -> dict[str, Any]:
    """Run (or resume) GRPO into ``out``; returns a summary with the step log and the accounting.

    ``job``: the job name its metrics carry (``osvl.rl.job.JOB``).

    ``actor_prefix``: when set, the buffer and rollout actors are named ``<prefix>buffer``,
    ``<prefix>rollout0``, ... (``ray.get_actor``), for inspection and fault injection.
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    # lazy: (d) keeps ray out of jobs/grpo.py --help
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    check_transport(parts.learner.weights)
    tracking.check(parts.run.tracking)  # a missing W&B / MLflow fails here, not in the learner's rank 0
    if parts.learner.freeze_vision and parts.rollout.engine == "vllm":
        # vLLM reloads layer by layer and counts a layer nothing wrote as unloaded: it would refuse every version
        raise ConfigError("learner.freeze_vision with rollout.engine=vllm: versions leave the vision tower out, "
                          "which vLLM's weight reload refuses; train the whole model or use the HF engine")
    parts.rollout.check()
    tc, rc = parts.train, parts.rollout
    start_cluster(parts.rollout, parts.learner)
    ckpt_root = out / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    image_dir = out / "images"
    log_path = out / "steps.jsonl"
    resume = ckpt.latest(ckpt_root)
    if resume is not None and int(resume.name.removeprefix(ckpt.PREFIX)) >= tc.steps \
            and (out / "summary.json").is_file():  # a finished run, resubmitted: start no actor and no learner
        log(f"resuming from {resume.name}: all {tc.steps} steps trained, nothing to run")
        rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
        return {**json.loads((out / "summary.json").read_text()), "rows": rows, "resumed_from": resume.name,
                "checkpoint": str(resume)}
    named = (lambda n: {"name": actor_prefix + n}) if actor_prefix else (lambda n: {})  # noqa: E731
    # the buffer and the weight store live on the driver's node (the head in production): losing a
    # worker node must not take the run's ledger with it, and losing the driver ends the run anyway
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    buffer = ray.remote(TrajectoryBuffer).options(num_cpus=0, scheduling_strategy=here, **named("buffer")).remote(
        len(questions), tc.groups_per_step, tc.steps, tc.max_staleness, parts.run.seed, tc.max_attempts,
        tc.resample_flat)
    if resume is not None:
        ray.get(buffer.load_state.remote(ckpt.load_buffer_state(resume), tc.steps))
        log(f"resuming from {resume.name}: buffer cursor and ledger restored, slots in flight re-issued")
        model_dir = resume / "hf"  # the actors start from the checkpoint's policy (the learner republishes it)
    elif log_path.exists():
        log_path.unlink()  # a fresh run: no stale rows from a run that died before its first checkpoint
    store = ray.remote(WeightStore).options(num_cpus=0, scheduling_strategy=here).remote()
    questions_ref = ray.put(questions)
    rec = Recorder(job, out.name)  # every series of this run: osvl_job="grpo", run=<run folder name>

    image_dir.mkdir(parents=True, exist_ok=True)
    # locations, not paths (osvl.storage): actors and learner workers may run on other nodes
    where = {"model": storage.location(model_dir), "questions": storage.location(question_image_dir),
             "images": storage.location(image_dir)}

    def make_actor(name: str) -> Any:
        return rollout_actor_class(RolloutWorker, rc, **named(name)).remote(
            name, rc, where["model"], questions_ref, where["questions"], where["images"], buffer, store,
            parts.rl.group_size, parts.rl.mask_at, rec)

    settings = LoopSettings(rl=parts.rl, learner=parts.learner, run=parts.run, model_dir=where["model"],
                            image_dir=where["images"], run_folder=storage.location(out), buffer=buffer, store=store,
                            recorder=rec, steps=tc.steps, ckpt_every=tc.ckpt_every, keep=tc.keep,
                            weights_every=tc.weights_every, temperature=parts.rollout.agent.temperature,
                            max_staleness=tc.max_staleness)
    t0 = time.perf_counter()
    # the learner's GPUs are reserved before any rollout actor's (osvl/rl/placement.py): actors SPREAD first
    # would take GPUs on every node and split the learner's group; its train loop publishes the weights
    # and then waits for the actors' groups in buffer.take
    learner = start_learner(make_learner(train_loop, {"settings": settings}, parts.learner, out))
    actors = {f"rollout{i}": make_actor(f"rollout{i}") for i in range(rc.workers)}
    monitor = Monitor(make_actor, buffer, actors, log_path, print_row or (lambda row: None), tc.max_actor_restarts,
                      log, rec)
    monitor.start()
    try:
        learner.join()
    finally:
        monitor.stop.set()
        monitor.join(timeout=30)
    storage.refresh(out)  # checkpoints and the step log from learner ranks on other nodes
    seconds = time.perf_counter() - t0
    stats = ray.get(buffer.stats.remote())
    ledger = ray.get(buffer.ledger.remote())
    events = ray.get(buffer.events.remote())
    final = ray.get(store.latest_version.remote())
    # a replacement actor that joined during the last step may still be loading its model (or be inside the
    # rendezvous of a group listed before the last version); then the store sends it to the stored last version:
    # on a busy node that took minutes, so two beside the polls (a healthy run returns as soon as all hold it)
    actor_stats = final_actor_stats(monitor, final, timeout_s=2 * rc.weight_poll_s + 120)
    events += [f"stale_engine {s['actor']}: version {s['version']} at the end, the learner's last is {final}"
               for s in actor_stats if s.get("alive") and s["version"] != final]
    for a in monitor.actors.values():
        ray.kill(a)
    for h in (buffer, store):
        ray.kill(h)
    rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    summary = {"seconds": seconds, "buffer": stats, "ledger": ledger, "events": events, "restarts": monitor.restarts,
               "actors": actor_stats, "rows": rows, "resumed_from": resume.name if resume else "",
               "checkpoint": str(ckpt.latest(ckpt_root) or "")}
    (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "rows"}, default=str))
    publish(out)
    return summary


def final_actor_stats(monitor: Monitor, version: int, timeout_s: float) -> list[dict[str, Any]]:
    """Every rollout actor's counters at the end of the run, once its engine holds ``version`` (the
    learner's last; its weight sync goes on after its groups are done) or ``timeout_s`` has passed;
    ``alive`` marks the actors that could still answer (a dead one reports what its run returned)."""
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    live = {n: a for n, a in monitor.actors.items() if _alive(a)}
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {n: ray.get(a.get_stats.remote(), timeout=30) for n, a in live.items()}
        if all(s["version"] >= version for s in stats.values()) or time.monotonic() > deadline:
            stats = {n: ray.get(a.get_stats.remote(with_digest=True), timeout=120) for n, a in live.items()}
            break
        time.sleep(0.5)
    return [{**s, "alive": True} for s in stats.values()] + [
        {**s, "alive": False} for n, s in monitor.finished.items() if n not in live]


def _alive(actor: Any) -> bool:
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    try:
        ray.get(actor.pid.remote(), timeout=5)
        return True
    except Exception:  # noqa: BLE001 - any failure means it cannot report
        return False
