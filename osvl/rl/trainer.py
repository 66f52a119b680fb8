"""The GRPO launcher: wires the buffer, the weight store, the rollout actors and the learner.

    driver ── TrajectoryBuffer (actor) ◄── RolloutWorker x N (actors: engine + agent loop)
       │            │ take(step)                 ▲ weights (WeightStore, versioned)
       └── Ray Train workers (learner, DeepSpeed) ┘

Order matters for resume: the latest checkpoint is read first, the buffer is
rebuilt from it (data cursor, ledger, ready groups; slots in flight re-issued), and
only then do rollout actors start asking for work; the learner loads its model and
Adam state from the same checkpoint and publishes its version before it waits for
a batch, so no actor generates with weights older than the gate allows.

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
from typing import Any

from osvl import storage
from osvl.config import RunConfig, opt
from osvl.logs import Progress
from osvl.rl.learner import RLConfig
from osvl.rl.loss import MODES
from osvl.rl.rollout import RolloutConfig
from osvl.storage import publish

logger = logging.getLogger(__name__)

JOB = "grpo"


@dataclass
class LearnerConfig:
    """The learner's Ray Train workers."""

    num_workers: int = opt(1, "Ray Train learner workers (data parallel over whole groups).", hashed=False)
    role_units: float = opt(0.0, "Units of the 'learner' custom resource (osvl.cluster.ROLE_RESOURCES, declared on "
                                 "learner nodes by cluster.yaml and deploy/) each learner worker requests; 0 = none.",
                            hashed=False)
    threads_per_worker: int = opt(1, "CPUs (and torch threads) per learner worker.", hashed=False)
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (0-3).", hashed=False)
    use_gpu: bool = opt(False, "Learner workers on GPUs (NCCL, one GPU each).", hashed=False)
    max_failures: int = opt(1, "Ray Train restarts of a failed learner worker group (resumes from the checkpoint).",
                            hashed=False)
    weights: str = opt("object_store", "How weights reach the rollout actors: object_store (CPU and GPU, any "
                       "engine) or nccl (GPU broadcast into vLLM; not implemented yet).", hashed=False)


@dataclass
class TrainConfig:
    """What one GRPO run does once the model and the questions exist."""

    steps: int = opt(40, "Learner steps.")
    groups_per_step: int = opt(2, "Groups (questions) per learner step; the batch is groups_per_step x G.")
    max_staleness: int = opt(1, "Max policy-version lag of a trained group's oldest turn (0 = synchronous).")
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
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


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
        import ray

        from osvl.metrics import ROLLOUT_ACTORS_LIVE, ROLLOUT_RESTARTS

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
        if not self.log_path.exists():
            return
        with self.log_path.open() as f:
            f.seek(self._offset)
            for line in f:
                if line.endswith("\n"):
                    self._offset += len(line.encode())
                    self.print_row(json.loads(line))


def start_cluster(rc: RolloutConfig, lc: LearnerConfig) -> None:
    """Join ``$RAY_ADDRESS`` or start a local cluster sized for the run: what the actors and workers
    reserve, plus one for Ray Train's controller (on a 2-core machine the demo asks for 3 logical
    CPUs: the cores are shared, not oversubscribed by much)."""
    from osvl.cluster import init_ray

    need = int(rc.num_actors * rc.cpus_per_actor + lc.num_workers * lc.threads_per_worker) + 1
    init_ray(num_cpus=max(need, os.cpu_count() or 1))


def train(parts: GRPOParts, model_dir: str | Path, questions: list[dict[str, Any]], question_image_dir: str | Path,
          out: Path, log: Callable[[str], None] = logger.info, print_row: Callable[[dict], None] | None = None,
          actor_prefix: str = "") -> dict[str, Any]:
    """Run (or resume) GRPO into ``out``; returns a summary with the step log and the accounting.

    ``actor_prefix``: when set, the buffer and rollout actors are named ``<prefix>buffer``,
    ``<prefix>rollout0``, ... (``ray.get_actor``), for inspection and fault injection.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from osvl.cluster import role_resources
    from osvl.metrics import Recorder
    from osvl.rl import checkpoint as ckpt
    from osvl.rl.buffer import TrajectoryBuffer
    from osvl.rl.learner import train_loop
    from osvl.rl.rollout import RolloutWorker
    from osvl.rl.weights import WeightStore, check_transport
    from osvl.train.deepspeed import make_trainer

    check_transport(parts.learner.weights)
    tc, rc = parts.train, parts.rollout
    start_cluster(parts.rollout, parts.learner)
    ckpt_root = out / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    image_dir = out / "images"
    log_path = out / "steps.jsonl"
    resume = ckpt.latest(ckpt_root)
    named = (lambda n: {"name": actor_prefix + n}) if actor_prefix else (lambda n: {})  # noqa: E731
    # the buffer and the weight store live on the driver's node (the head in production): losing a
    # worker node must not take the run's ledger with it, and losing the driver ends the run anyway
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    buffer = ray.remote(TrajectoryBuffer).options(num_cpus=0, scheduling_strategy=here, **named("buffer")).remote(
        len(questions), tc.groups_per_step, tc.steps, tc.max_staleness, parts.run.seed, tc.max_attempts)
    if resume is not None:
        ray.get(buffer.load_state.remote(ckpt.load_buffer_state(resume), tc.steps))
        log(f"resuming from {resume.name}: buffer cursor and ledger restored, slots in flight re-issued")
        model_dir = resume / "hf"  # the actors start from the checkpoint's policy (the learner republishes it)
    elif log_path.exists():
        log_path.unlink()  # a fresh run: no stale rows from a run that died before its first checkpoint
    store = ray.remote(WeightStore).options(num_cpus=0, scheduling_strategy=here).remote()
    questions_ref = ray.put(questions)
    rec = Recorder(JOB, out.name)  # every series of this run: osvl_job="grpo", run=<run folder name>

    image_dir.mkdir(parents=True, exist_ok=True)
    # locations, not paths (osvl.storage): actors and learner workers may run on other nodes
    where = {"model": storage.location(model_dir), "questions": storage.location(question_image_dir),
             "images": storage.location(image_dir)}

    def make_actor(name: str) -> Any:
        return ray.remote(RolloutWorker).options(
            num_cpus=rc.cpus_per_actor, num_gpus=rc.num_gpus, resources=role_resources("rollout", rc.role_units),
            scheduling_strategy="SPREAD",  # over the rollout nodes: losing one node loses the fewest actors
            max_restarts=0, **named(name)).remote(
            name, rc, where["model"], questions_ref, where["questions"], where["images"], buffer, store,
            parts.rl.group_size, parts.rl.mask_at, rec)

    actors = {f"rollout{i}": make_actor(f"rollout{i}") for i in range(rc.num_actors)}
    monitor = Monitor(make_actor, buffer, actors, log_path, print_row or (lambda row: None), tc.max_actor_restarts,
                      log, rec)
    monitor.start()
    loop_config = {"rl": parts.rl, "model_dir": where["model"], "image_dir": where["images"], "buffer": buffer,
                   "store": store, "steps": tc.steps, "run": storage.location(out),
                   "ckpt_every": tc.ckpt_every, "keep": tc.keep, "zero_stage": parts.learner.zero_stage,
                   "threads": parts.learner.threads_per_worker,
                   "weights_every": tc.weights_every, "seed": parts.run.seed,
                   "temperature": parts.rollout.temperature, "recorder": rec,
                   "max_staleness": tc.max_staleness}
    t0 = time.perf_counter()
    try:
        trainer = make_trainer(train_loop, loop_config, num_workers=parts.learner.num_workers,
                               threads_per_worker=parts.learner.threads_per_worker, use_gpu=parts.learner.use_gpu,
                               storage=out, name="ray_train", keep=1,
                               max_failures=parts.learner.max_failures,
                               resources=role_resources("learner", parts.learner.role_units))
        trainer.fit()
    finally:
        monitor.stop.set()
        monitor.join(timeout=30)
    storage.refresh(out)  # checkpoints and the step log from learner ranks on other nodes
    seconds = time.perf_counter() - t0
    stats = ray.get(buffer.stats.remote())
    ledger = ray.get(buffer.ledger.remote())
    events = ray.get(buffer.events.remote())
    actor_stats = [ray.get(a.get_stats.remote()) for n, a in monitor.actors.items() if n not in monitor.finished
                   and _alive(a)] + list(monitor.finished.values())
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


def _alive(actor: Any) -> bool:
    import ray

    try:
        ray.get(actor.pid.remote(), timeout=5)
        return True
    except Exception:  # noqa: BLE001 - any failure means it cannot report
        return False


# ---------------------------------------------------------------------------
# the job: data, SFT'd model, GRPO, evaluation


@dataclass
class EvalConfig:
    n_heldout: int = opt(50, "Held-out questions for greedy Pass@1 after SFT and after GRPO (0 skips it).")
    concurrency: int = opt(16, "Evaluation episodes in flight.", hashed=False)


@dataclass
class GRPOConfig:
    """jobs/grpo.py: build or reuse questions, expert trajectories and the SFT'd model, then GRPO."""

    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    questions: str = opt("", "Synthesize run folder (rl/heldout.parquet + images/); empty = build or reuse the "
                             "synthesize job's run with the synth section below.")
    model: str = opt("", "Policy to start from (HF directory); empty = build or reuse expert trajectories "
                         "(trajectories section) and SFT (sft section) first.")
    max_questions: int = opt(0, "RL questions used (the first by id); 0 = all of rl.parquet.")
    synth: dict[str, Any] = opt({}, "Overrides of the synthesize job's config (same keys as jobs/synthesize.py).")
    trajectories: dict[str, Any] = opt({}, "Overrides of the trajectories job's config (keys of jobs/trajectories.py).")
    sft: dict[str, Any] = opt({}, "Overrides of the SFT job's config (same keys as jobs/sft.py).")
    rl: RLConfig = opt(RLConfig, "Fatal-aware GRPO knobs.")
    rollout: RolloutConfig = opt(RolloutConfig, "Rollout actors and agent budgets.")
    learner: LearnerConfig = opt(LearnerConfig, "Learner workers.")
    train: TrainConfig = opt(TrainConfig, "Steps, batch and staleness.")
    eval: EvalConfig = opt(EvalConfig, "Held-out Pass@1.")


def prepare(cfg: GRPOConfig, log: Callable[[str], None] = logger.info) -> tuple[Path, Path]:
    """(synthesize run folder, policy HF folder): given, or built/reused by the other jobs' library functions."""
    from osvl.config import upstream_config
    from osvl.synth import pipeline

    if cfg.questions:
        qdir = Path(cfg.questions)
    else:
        qdir, _ = pipeline.run(upstream_config(pipeline.SynthConfig, pipeline.JOB, cfg.run, cfg.synth), log=log)
    qdir = qdir.resolve()  # Ray Train workers and actors run in other folders
    if cfg.model:
        return qdir, Path(cfg.model).resolve()
    from osvl.agent import expert
    from osvl.train import sft

    # the teacher's records must show the policy the tools it will be offered in RL (the system
    # prompt is part of every SFT row), so rollout.offer is the trajectories job's default
    tcfg = upstream_config(expert.TrajConfig, expert.JOB, cfg.run,
                           {"questions": str(qdir), "offer": list(cfg.rollout.offer), **cfg.trajectories})
    tdir, _ = expert.run(tcfg, log=log)
    scfg = upstream_config(sft.SftConfig, sft.JOB, cfg.run, cfg.sft)
    scfg = merge_data(scfg, tdir, qdir)
    from osvl.config import run_dir

    done = run_dir(scfg, sft.JOB) / "report.json"
    if done.is_file():
        model = done.parent / "model"  # not the report's absolute path: the folder may be another node's mirror
        log(f"sft: reusing {model}")
        return qdir, model.resolve()
    return qdir, Path(sft.run(scfg, log=log)["model"]).resolve()


def merge_data(scfg: Any, tdir: Path, qdir: Path) -> Any:
    from osvl.config import merge

    return merge(scfg, {"data": {"trajectories": str(tdir), "heldout": str(qdir / "heldout.parquet")}})


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, (var / n) ** 0.5


def summarize(rows: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """First vs last ``window`` steps' mean reward (with standard errors), the clamp split, the staleness mix."""
    rewards = [r["reward"] for r in rows]
    first, last = mean_se(rewards[:window]), mean_se(rewards[-window:])
    clamped = sum(r.get("clamped", 0) for r in rows)
    kept = sum(r.get("kept_positive", 0) for r in rows)
    fatal = clamped + kept
    return {"steps": len(rows), "first_mean": first[0], "first_se": first[1], "last_mean": last[0],
            "last_se": last[1], "improved": last[0] - first[0] > 2 * (first[1] ** 2 + last[1] ** 2) ** 0.5,
            "clamped": clamped, "kept_positive": kept,
            "clamped_share": clamped / fatal if fatal else float("nan"),
            "fatal_rate": sum(r["fatal_rate"] for r in rows) / max(1, len(rows)),
            "skipped": sum(bool(r.get("skipped")) for r in rows),
            "staleness": rows[-1]["staleness"] if rows else {}}


COLUMNS = (("step", "{:>4d}"), ("reward", "{:6.3f}"), ("r_fmt", "{:5.2f}"), ("r_acc", "{:5.2f}"),
           ("r_query", "{:5.2f}"), ("fatal_rate", "{:5.2f}"), ("clamped", "{:>3d}"), ("kept_positive", "{:>3d}"),
           ("mask_coverage", "{:5.2f}"), ("kl", "{:7.4f}"), ("entropy", "{:5.2f}"), ("clip_fraction", "{:5.3f}"),
           ("step_s", "{:6.1f}"), ("wait_s", "{:6.1f}"), ("buffer_ready", "{:>3d}"))
HEADER = ("step reward r_fmt r_acc r_qry fatal clp kep  mask      kl   ent  clip  step_s  wait_s buf  staleness")


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for key, spec in COLUMNS:
        v = row.get(key)
        cells.append(spec.format(v) if v is not None else "-")
    return " ".join(cells) + "  " + json.dumps(row.get("staleness", {}))


def run(cfg: GRPOConfig, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """The whole job (see GRPOConfig); prints a per-step table and a final summary, returns the summary."""
    from osvl.config import run_dir
    from osvl.rl.rollout import pass_at_1

    t0 = time.perf_counter()
    qdir, model = prepare(cfg, log)
    questions = sorted(read_questions(qdir / "rl.parquet"), key=lambda r: r["id"])
    if cfg.max_questions:
        questions = questions[:cfg.max_questions]
    heldout = sorted(read_questions(qdir / "heldout.parquet"), key=lambda r: r["id"])[:cfg.eval.n_heldout]
    out = run_dir(cfg, JOB).resolve()
    start_cluster(cfg.rollout, cfg.learner)  # the evaluations run on the cluster too
    log(f"grpo: mode {cfg.rl.mode}, {cfg.train.steps} steps x {cfg.train.groups_per_step} groups x G="
        f"{cfg.rl.group_size}, max_staleness {cfg.train.max_staleness}, {len(questions)} RL questions, "
        f"policy {model} -> {out}")
    before = None
    sft_eval = out / "pass1_sft.json"  # kept, so that a resumed run still reports it
    if heldout and sft_eval.is_file():
        before = json.loads(sft_eval.read_text())["pass1"]
    elif heldout and not (out / "checkpoints").is_dir():
        before = pass_at_1(model, heldout, qdir / "images", cfg.rollout, cfg.eval.concurrency)
        log(f"grpo: held-out Pass@1 after SFT (greedy, {len(heldout)} questions): {before:.3f}")
        sft_eval.write_text(json.dumps({"pass1": before}))
        publish(out, sft_eval.name)
    parts = GRPOParts(run=cfg.run, rl=cfg.rl, rollout=cfg.rollout, learner=cfg.learner, train=cfg.train)
    log(HEADER)
    with Progress(cfg.train.steps, "grpo", "steps") as bar:
        def show(row: dict[str, Any]) -> None:
            log(format_row(row))
            bar.update(1, reward=row["reward"], fatal=row["fatal_rate"])

        res = train(parts, model, questions, qdir / "images", out, log=log, print_row=show)
    summary = summarize(res["rows"])
    after = None
    if heldout and res["checkpoint"]:
        after = pass_at_1(Path(res["checkpoint"]) / "hf", heldout, qdir / "images", cfg.rollout,
                          cfg.eval.concurrency)
    st = res["buffer"]
    summary.update(pass1_sft=before, pass1_grpo=after, seconds=time.perf_counter() - t0, train_s=res["seconds"],
                   issued=st["issued_total"], consumed=st["consumed"], dropped=st["dropped"],
                   restarts=res["restarts"], resumed_from=res["resumed_from"], mode=cfg.rl.mode, out=str(out))
    drops = [e for e in res["events"] if e.startswith("dropped")]
    log(f"\ngrpo summary ({cfg.rl.mode}): {summary['steps']} steps in {res['seconds']:.0f} s "
        f"({3600 * summary['steps'] / max(res['seconds'], 1e-9):.0f} steps/hour)")
    log(f"  mean reward, first 10 steps: {summary['first_mean']:.4f} ± {summary['first_se']:.4f} (SE); "
        f"last 10: {summary['last_mean']:.4f} ± {summary['last_se']:.4f}; "
        f"{'higher by more than 2 SE' if summary['improved'] else 'NOT higher by more than 2 SE'}")
    clamps = MODES[cfg.rl.mode].clamp_fatal
    applied = "" if clamps else f" ({cfg.rl.mode} does not clamp)"
    log(f"  clamp split{applied}: of {summary['clamped'] + summary['kept_positive']} fatal trajectories with a "
        f"non-zero advantage, {summary['clamped']} negative{' -> clamped to 0' if clamps else ''}, "
        f"{summary['kept_positive']} positive kept"
        + (f" ({summary['clamped_share']:.1%} / {1 - summary['clamped_share']:.1%})"
           if summary["clamped"] + summary["kept_positive"] else "")
        + f"; mean fatal rate {summary['fatal_rate']:.2f}")
    log(f"  groups: {st['issued_total']} issued, {st['consumed']} trained, {st['dropped']} dropped"
        + (f" ({'; '.join(drops[:3])})" if drops else "") + f"; staleness of trained groups {st['staleness']}; "
        f"{len(res['restarts'])} rollout-actor restarts; {summary['skipped']} non-finite steps skipped")
    shown = ["n/a" if v is None else f"{v:.3f}" for v in (before, after)]
    log(f"  held-out Pass@1 ({len(heldout)} questions, greedy): after SFT {shown[0]}, after GRPO {shown[1]}")
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    publish(out)
    return summary
