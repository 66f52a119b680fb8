"""The GRPO learner's Ray Train worker: a step's groups become this rank's batch, then the loop.

``rank_share`` / ``rl_batch`` turn the groups the buffer hands out into this rank's padded
micro-batches (whole groups, sorted by length; stand-in rows where a rank has fewer, so every rank
joins every collective); ``train_loop`` takes a step's groups, updates (``osvl.rl.learner.Learner``),
publishes weights, checkpoints, and writes the step's row and the training curves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from osvl import metrics as M
from osvl import storage
from osvl.plots import training_curves
from osvl.rl import checkpoint as ckpt
from osvl.rl.learner import (
    Learner,
    RLConfig,
    StepResult,
    learner_ds_config,
    make_engine,
    mask_starts,
)
from osvl.rl.loss import group_advantages, stats_members
from osvl.rl.weights import Publisher
from osvl.tracking import Tracker
from osvl.train import (
    device,  # device.all_reduce, looked up at each call: the GPU rehearsal's plant replaces it
    rehearsal,
)
from osvl.train.batch import collate
from osvl.train.deepspeed import hidden_size, init_engine, load_trainable, partitioned_copy
from osvl.train.device import group_device

if TYPE_CHECKING:  # the launcher's module imports this one when it starts the learner
    from osvl.config import RunConfig
    from osvl.rl.trainer import LearnerConfig

def _trainable(tr: Any, cfg: RLConfig) -> bool:
    """Whether ``rl_batch`` keeps the record (the ``drop`` policy drops rows over ``max_len``)."""
    return len(tr.input_ids) <= cfg.max_len or cfg.truncation != "drop"


def _tokens(tr: Any, cfg: RLConfig) -> int:
    """Tokens of a trainable record as collate feeds it (a ``cut`` record keeps at most ``max_len``)."""
    return min(len(tr.input_ids), cfg.max_len)


Piece = tuple[Sequence[Any], tuple[int, ...]]  # a group and the indices of the rows of it a micro-batch holds


def micro_batches(groups: Sequence[Sequence[Any]], cfg: RLConfig) -> list[list[Piece]]:
    """The trainable rows of ``groups`` packed into micro-batches of at most ``rl.micro_tokens`` tokens, padding
    excluded (a row larger than that is a micro-batch alone; 0: all in one), each a list of pieces
    ``(group, row indices)``.

    A token budget rather than a row count because a forward's activation and logit memory grows with
    its tokens: 8 rows of 800 tokens and 8 of 16,384 are 20 times apart, and one GRPO group of 8 x 16,384
    tokens does not fit a GPU at 8B (``--check``). So a group may be split over consecutive micro-batches:
    its advantages are computed over the whole group first (``rl_batch`` gets the group, and the rows),
    so a split changes the memory, not the update. Groups go in order of their longest trainable row
    and each group's rows shortest first, so rows of similar length share a micro-batch and little is
    padded; on CPU a step of 32 long rows in one padded batch cost several times its sorted
    micro-batches (docs/measurements.md, ``bench/learner.py``).
    """
    trainable = [(g, [i for i, tr in enumerate(g) if _trainable(tr, cfg)]) for g in groups]
    out: list[list[Piece]] = []
    size = 0
    for g, rows in sorted(((g, rs) for g, rs in trainable if rs), key=lambda p: max(_tokens(p[0][i], cfg)
                                                                                        for i in p[1])):
        for i in sorted(rows, key=lambda i: _tokens(g[i], cfg)):
            n = _tokens(g[i], cfg)
            if not out or (cfg.micro_tokens and size and size + n > cfg.micro_tokens):
                out.append([])
                size = 0
            if out[-1] and out[-1][-1][0] is g:
                out[-1][-1] = (g, (*out[-1][-1][1], i))
            else:
                out[-1].append((g, (i,)))
            size += n
    return out


def rank_share(groups: Sequence[Sequence[Any]], rank: int, world: int,
               cfg: RLConfig) -> list[tuple[list[Piece], bool]] | None:
    """This rank's micro-batches of a step, each ``(pieces, live)`` (``micro_batches``); None when the step
    trains nothing.

    Rank r takes groups r, r + world, ... Every rank sees the step's full list of groups, so
    each decides the same thing without a collective, and every rank gets the same number of
    micro-batches: each one's backward joins DeepSpeed's gradient reduction, and the divisor's sum
    is a collective too. A rank short of micro-batches (fewer groups than ranks, rows dropped for
    length, shorter rows) makes up the count with stand-ins: the step's shortest trainable record,
    trained with weight 0 (``live=False``). When no row of the step is trainable, every rank skips it.
    """
    rows = [tr for g in groups for tr in g if _trainable(tr, cfg)]
    if not rows:
        return None
    shares = [micro_batches(groups[r::world], cfg) for r in range(world)]
    stand_in: list[Piece] = [([min(rows, key=lambda tr: len(tr.input_ids))], (0,))]
    mine = [(chunk, True) for chunk in shares[rank]]
    return mine + [(stand_in, False)] * (max(len(s) for s in shares) - len(mine))


def rl_batch(groups: Sequence[Sequence[Any] | Piece], image_dir: str, processor: Any,
             cfg: RLConfig) -> dict[str, torch.Tensor]:
    """Collate scored groups of ``Trajectory`` records, or pieces of them (``micro_batches``), and add the
    per-row GRPO fields.

    Each row's normalised reward (``raw_adv``) is computed over its whole group's trainable rows, also
    when the batch holds only some of them (a group split over micro-batches). Rows that collate would
    drop (longer than ``max_len`` under the ``drop`` policy) leave their group first, so the group
    statistics use the rows that are actually trained.
    """
    keep: list[Any] = []
    group_ix: list[int] = []
    raw: list[torch.Tensor] = []
    for g, item in enumerate(groups):
        trajs, rows = item if isinstance(item, tuple) else (item, None)
        trainable = [i for i, tr in enumerate(trajs) if _trainable(tr, cfg)]
        fatal = torch.tensor([trajs[i].fatal_kth >= 0 for i in trainable], dtype=torch.bool)
        rewards = torch.tensor([trajs[i].reward for i in trainable])
        adv = dict(zip(trainable, group_advantages(rewards.roll(1) if cfg.null_control else rewards,
                                                   torch.zeros(len(trainable), dtype=torch.long),
                                                   baseline=cfg.baseline, member=stats_members(fatal, cfg.mode)),
                       strict=True))
        for i in trainable if rows is None else rows:
            keep.append(trajs[i])
            group_ix.append(g)
            raw.append(adv[i])
    batch = collate(keep, image_dir, processor, cfg.max_len, cfg.truncation)
    batch["reward"] = torch.tensor([tr.reward for tr in keep], dtype=torch.float32)
    batch["group"] = torch.tensor(group_ix, dtype=torch.long)
    batch["raw_adv"] = torch.stack(raw) if raw else torch.zeros(0)
    batch["fatal"] = torch.tensor([tr.fatal_kth >= 0 for tr in keep], dtype=torch.bool)
    batch["mask_start"] = mask_starts([tr.fatal_cascade_start for tr in keep], [tr.fatal_kth for tr in keep],
                                      cfg.mask_at)
    return batch


def reference_model(model_dir: Any, cfg: RLConfig, ds_cfg: dict[str, Any],
                    policy: torch.nn.Module | None = None) -> Any:  # pragma: no mutate block
    """The frozen starting policy the KL term compares against, built as the policy is (``ds_cfg``: its dtype,
    and under ZeRO-3 partitioned over the ranks in an optimiser-less DeepSpeed engine, as OpenRLHF keeps it);
    on the accelerator either way. Under ZeRO-3, ``policy`` (the freshly built policy, before its engine)
    is copied partition by partition instead of reading the checkpoint again. None when ``cfg.beta`` is 0."""
    if cfg.beta <= 0:
        return None
    if ds_cfg["zero_optimization"]["stage"] == 3:
        ref = partitioned_copy(policy, ds_cfg) if policy is not None else load_trainable(model_dir, ds_cfg,
                                                                                        frozen=True).eval()
        engine = init_engine(ref, None, None, {k: v for k, v in ds_cfg.items() if k != "gradient_clipping"})
        engine.eval()  # DeepSpeed's eval() returns None, not the engine
        return engine
    return load_trainable(model_dir, ds_cfg, frozen=True).eval().to(group_device())


@dataclass
class LoopSettings:
    """What the launcher (``osvl.rl.trainer.train``) hands every learner rank, inside Ray Train's config dict."""

    rl: RLConfig
    learner: LearnerConfig  # threads, ZeRO stage, dtype, checkpointing, rehearsal
    run: RunConfig  # the job's: seed, and run.tracking (where rank 0 logs the step rows: osvl/tracking.py)
    model_dir: str  # storage locations (osvl.storage): this node may hold no copy yet
    image_dir: str
    run_folder: str  # checkpoints and steps.jsonl
    buffer: Any  # the trajectory buffer's and the weight store's actor handles
    store: Any
    recorder: Any  # osvl.metrics.Recorder of the run
    steps: int
    ckpt_every: int
    keep: int  # checkpoints kept
    weights_every: int  # steps between weight versions published to the rollout engines
    temperature: float  # the rollouts' sampling temperature: the learner scores log-probs at it
    max_staleness: int


def train_loop(config: dict[str, LoopSettings]) -> None:  # pragma: no mutate block
    """The Ray Train worker function: take a step's groups, update, publish, checkpoint; repeat.

    ``config["settings"]``: the ``LoopSettings`` the launcher built. Every rank trains on its share of the
    step's groups (whole groups: the advantages are per group; ``rank_share``) over the step's global
    divisor, so any number of groups on any number of ranks gives the one-worker gradient (``Learner.step``).
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    st = config["settings"]
    cfg: RLConfig = st.rl
    lc = st.learner
    torch.set_num_threads(lc.threads_per_worker)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(st.run.seed + rank)
    model_dir = storage.attach(st.model_dir)  # a location: this node may hold no copy yet
    image_dir = storage.attach(st.image_dir)
    # the run folder as this node sees it (the driver's mirror, or a fresh one on another node)
    run_folder = storage.attach(st.run_folder)
    ckpt_root, log_path = run_folder / "checkpoints", run_folder / "steps.jsonl"
    rehearsal.install(lc.rehearsal, run_folder, rank)
    ds_cfg = learner_ds_config(cfg, zero_stage=lc.zero_stage, world=world,
                               bf16=lc.bf16 if lc.bf16 is not None else lc.use_gpu,
                               hidden_size=hidden_size(model_dir), on_gpu=lc.use_gpu)
    model = load_trainable(model_dir, ds_cfg, grad_checkpointing=lc.grad_checkpointing)
    if lc.freeze_vision:  # trained on the language model only; versions then leave the vision tower out
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    processor = load_processor(model_dir)
    ref = reference_model(model_dir, cfg, ds_cfg, policy=model)
    engine = make_engine(model, cfg, config=ds_cfg)
    rehearsal.note_peak("load")
    learner = Learner(engine, cfg, ref_model=ref, temperature=st.temperature)
    buffer, store = st.buffer, st.store
    # the newest complete checkpoint (at the run root when it is remote), every rank's shards on every node
    resume = ckpt.resume_point(ckpt_root, rank, ctx.get_local_rank(), world)
    if rank == 0 and ray.get(buffer.begin_learner.remote()) > 0:
        # a restarted worker group (FailureConfig): the buffer moved on since the checkpoint (or the
        # start), so it goes back there too; answers then in flight are refused as duplicates
        ray.get(buffer.rewind.remote(ckpt.load_buffer_state(resume) if resume is not None else None))
    if world > 1:
        dist.barrier()
    if resume is not None:
        client = ckpt.load_learner(engine, resume)
        learner.step_count, learner.skipped = client["step"], client["skipped"]
        ckpt.restore_rng(client["rng"][rank] if rank < len(client["rng"]) else client["rng"][0])
        if rank == 0:
            ckpt.write_probe(engine, ckpt_root / "resume_probe.json", client["version"])
            storage.publish(run_folder, "checkpoints/resume_probe.json")
    if world > 1:
        dist.barrier()  # every rank has loaded
    if ctx.get_local_rank() == 0:  # a remote run root holds the checkpoints: this node's copies are a cache
        ckpt.drop_local(ckpt_root)

    publisher = Publisher(store, lc.weights, rank, bucket_bytes=int(lc.weights_bucket_mb * 2**20),
                          timeout_s=lc.weights_timeout_s)
    pushed = learner.step_count

    def push(version: int, last: bool = False) -> float:
        nonlocal pushed
        # every rank: under ZeRO-3 each bucket is collected from every rank's partitions; the run's last
        # version is hashed (the last row's weights.sha256, which tests compare with every engine's)
        secs = publisher.push(engine, version, final=last)
        pushed = version
        if rank == 0:
            ray.get(buffer.advance.remote(version))
        return secs

    def take(step: int) -> list:
        """The step's groups; meanwhile, every few seconds, the newest version into the object store for an
        actor that asked (a restarted one: without it, it and this loop could wait for each other)."""
        ref = buffer.take.remote(step)
        while True:
            ready, _ = ray.wait([ref], timeout=CATCHUP_POLL_S)
            waiting = device.all_reduce(torch.tensor([0 if ready else 1]), op="max").item()  # every rank polls alike
            publisher.catch_up(engine, pushed)
            if not waiting:
                return ray.get(ref)

    sync_s = push(learner.step_count)
    if rank == 0:
        record_limits(st.recorder, cfg, st.max_staleness)
    log = open(log_path, "a") if rank == 0 else None  # noqa: SIM115 - closed below
    # the step rows' numbers to TensorBoard (W&B, MLflow: run.tracking) from rank 0, the writer of steps.jsonl
    tracker = Tracker.for_run(run_folder, st.run, job="grpo") if rank == 0 else Tracker.disabled()
    try:
        while learner.step_count + learner.skipped < st.steps:
            step = learner.step_count + learner.skipped
            t_wait = time.perf_counter()
            groups = take(step)
            wait_s = time.perf_counter() - t_wait
            share = rank_share(groups, rank, world, cfg)
            if share is not None:
                # images written by rollout actors on other nodes: fetched by name (a LIST of the run's images
                # per step would grow with the run)
                storage.fetch(image_dir, sorted({f"{sha}.png" for chunk, _ in share for g, _ in chunk for t in g
                                                 for sha in t.images}))  # those here already are skipped there
                res = learner.step([(rl_batch(chunk, str(image_dir), processor, cfg), live) for chunk, live in share])
                rehearsal.note_peak("step1")
            else:  # every group of the step dropped: nothing to learn from, the step still counts
                learner.skipped += 1
                res = None
            if (step + 1) % st.weights_every == 0 or step + 1 == st.steps:
                sync_s = push(learner.step_count + learner.skipped, last=step + 1 == st.steps)
            if (step + 1) % st.ckpt_every == 0 or step + 1 == st.steps:
                if world > 1:
                    dist.barrier()
                # every rank stores its own shards at the run root; complete once rank 0's marker is there
                ckpt.save(engine, ckpt_root, step + 1, learner, buffer, processor, rank, world,
                          keep=st.keep, local_rank=ctx.get_local_rank())
            if rank == 0:
                row = step_row(step, groups, res, wait_s, sync_s, ray.get(buffer.stats.remote()))
                row["weights"] = dict(publisher.stats)  # counters; sha256 on the last step
                log.write(json.dumps(row) + "\n")
                log.flush()
                storage.publish(run_folder, "steps.jsonl")
                tracker.log(row, row["step"])  # reward, fatal_rate, loss, kl, ... and the weights/ counters
                tracker.publish()
                record_metrics(st.recorder, row, st.steps)
                if (step + 1) % st.ckpt_every == 0 or step + 1 == st.steps:  # the last step is one
                    draw_curves(log_path)
        ckpt.wait_uploads()  # the run is done once its last checkpoint is stored and marked at the run root
    finally:
        if log is not None:
            log.close()
        tracker.close()


CATCHUP_POLL_S = 2.0  # how often a learner waiting for groups looks for an actor that needs a catch-up
CURVES = "curves.png"  # the training curves, redrawn at each checkpoint (osvl/plots.py)
CURVE_PANELS = [("reward parts", ["reward", "r_fmt", "r_acc", "r_query"]), ("fatal rate", ["fatal_rate"]),
                ("clamp split (fatal rows)", ["clamped", "kept_positive"]), ("KL to the reference", ["kl"]),
                ("entropy", ["entropy"]), ("clip fraction", ["clip_fraction"])]


def draw_curves(log_path: Path) -> None:  # pragma: no mutate block
    """``curves.png`` beside the step log, published when the run folder mirrors remote storage."""
    training_curves(log_path, CURVE_PANELS, log_path.parent / CURVES, title=f"GRPO {log_path.parent.name}")
    storage.publish(log_path.parent, CURVES)


def step_row(step: int, groups: Sequence[Sequence[Any]], res: StepResult | None, wait_s: float, sync_s: float,
             buffer_stats: dict[str, Any]) -> dict[str, Any]:  # pragma: no mutate block
    """One line of the per-step table: reward parts, fatal handling, optimisation and system figures."""
    trajs = [t for g in groups for t in g]
    n = max(1, len(trajs))
    fatal = [t for t in trajs if t.fatal_kth >= 0]
    row: dict[str, Any] = {
        "step": step + 1, "time": time.time(), "groups": len(groups), "trajectories": len(trajs),
        "reward": sum(t.reward for t in trajs) / n, "r_fmt": sum(t.r_fmt for t in trajs) / n,
        "r_acc": sum(t.r_acc for t in trajs) / n, "r_query": sum(t.r_query for t in trajs) / n,
        "accuracy": sum(t.r_acc >= 1.0 for t in trajs) / n, "fatal_rate": len(fatal) / n,
        "turns": sum(len(t.turns) for t in trajs) / n, "wait_s": wait_s, "weight_sync_s": sync_s,
        "buffer_ready": buffer_stats["ready"], "in_flight": buffer_stats["in_flight"],
        "dropped": buffer_stats["dropped"], "resampled": buffer_stats["resampled"],
        "staleness": buffer_stats["staleness"],
        "versions": sorted({t.policy_version for tr in trajs for t in tr.turns}),
        "group_ids": sorted({t.group_id for t in trajs}),
    }
    if res is not None:
        row.update(loss=res.loss, kl=res.kl, clip_fraction=res.clip_fraction, entropy=res.entropy,
                   mask_coverage=res.mask_coverage, grad_norm=res.grad_norm, skipped=res.skipped,
                   clamped=res.clamped, kept_positive=res.kept_positive, step_s=res.seconds, step_cpu_s=res.cpu_s,
                   tokens_per_s=res.tokens / max(res.seconds, 1e-9))
    return row


def record_limits(rec: Any, cfg: RLConfig, max_staleness: int) -> None:  # pragma: no mutate block
    """Export the run's bounds once, so alert rules compare KL, entropy and staleness against them."""
    for name, value in (("kl_max", cfg.kl_max), ("entropy_min", cfg.entropy_min), ("entropy_max", cfg.entropy_max),
                        ("max_staleness", max_staleness)):
        rec.set(M.RL_LIMIT, value, limit=name)


def record_metrics(rec: Any, row: Mapping[str, Any], steps: int) -> None:  # pragma: no mutate block
    """Export a step's figures through Ray's metric API (specs in osvl/metrics.py) with the run's labels."""
    if row["trajectories"]:  # a step whose groups were all dropped has no rates: a 0 would be a false dip
        for part in ("reward", "r_fmt", "r_acc", "r_query"):
            rec.set(M.RL_REWARD, row[part], part=part)
        rec.set(M.RL_ACCURACY, row["accuracy"])
        rec.set(M.RL_FATAL_RATE, row["fatal_rate"])
    rec.set(M.RL_BUFFER_DEPTH, row["buffer_ready"])
    rec.set(M.RL_RESAMPLED, row["resampled"])
    rec.observe(M.RL_WEIGHT_SYNC, row["weight_sync_s"])
    rec.set(M.RL_STEPS_LEFT, steps - row["step"])
    rec.set(M.RL_LAST_STEP, row["time"])
    if row["versions"]:
        rec.set(M.RL_STALENESS_NOW, row["step"] - 1 - min(row["versions"]))
    for age, count in row["staleness"].items():
        rec.set(M.RL_STALENESS, count, staleness=age)
    if "loss" in row:
        for split in ("clamped", "kept_positive"):
            rec.inc(M.RL_CLAMPED, row[split], split=split)
        rec.set(M.TRAIN_LOSS, row["loss"])
        rec.set(M.TRAIN_GRAD_NORM, row["grad_norm"])
        rec.set(M.RL_KL, row["kl"])
        rec.set(M.RL_CLIP_FRACTION, row["clip_fraction"])
        rec.set(M.RL_ENTROPY, row["entropy"])
        rec.set(M.RL_MASK_COVERAGE, row["mask_coverage"])
        rec.set(M.RL_TOKENS_PER_S, row["tokens_per_s"])
        rec.observe(M.RL_STEP_TIME, row["step_s"])
        rec.inc(M.RL_SKIPPED, int(bool(row["skipped"])))
