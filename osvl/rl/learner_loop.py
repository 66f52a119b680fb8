"""The GRPO learner's Ray Train worker: a step's groups become this rank's batch, then the loop.

``rank_share`` / ``rl_batch`` turn the groups the buffer hands out into this rank's padded
micro-batches (whole groups, sorted by length; stand-in rows where a rank has fewer, so every rank
joins every collective); ``train_loop`` takes a step's groups, updates (``osvl.rl.learner.Learner``),
publishes weights, checkpoints, and writes the step's row and the training curves.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from osvl.rl.learner import (
    Learner,
    RLConfig,
    StepResult,
    make_engine,
    mask_starts,
)


def _trainable(tr: Any, cfg: RLConfig) -> bool:
    """Whether ``rl_batch`` keeps the record (the ``drop`` policy drops rows over ``max_len``)."""
    return len(tr.input_ids) <= cfg.max_len or cfg.truncation != "drop"


def micro_batches(groups: Sequence[Sequence[Any]], cfg: RLConfig) -> list[list[Sequence[Any]]]:
    """Whole groups packed, in order of their longest trainable row, into micro-batches of at most
    ``rl.micro_rows`` trainable rows (a larger group is one micro-batch; 0: all in one).

    Rows of similar length share a micro-batch, so little is padded, and a forward/backward
    works on a few rows at a time: on CPU a step of 32 long rows in one padded batch cost
    several times its sorted micro-batches (docs/measurements.md, ``bench/learner.py``).
    Groups stay whole because the advantages are per group.
    """
    trainable = [(g, [len(tr.input_ids) for tr in g if _trainable(tr, cfg)]) for g in groups]
    out: list[list[Sequence[Any]]] = []
    size = 0
    for g, lengths in sorted(((g, ls) for g, ls in trainable if ls), key=lambda pair: max(pair[1])):
        n = len(lengths)
        if not out or (cfg.micro_rows and size + n > cfg.micro_rows):
            out.append([])
            size = 0
        out[-1].append(g)
        size += n
    return out


def rank_share(groups: Sequence[Sequence[Any]], rank: int, world: int,
               cfg: RLConfig) -> list[tuple[list[Sequence[Any]], bool]] | None:
    """This rank's micro-batches of a step, each ``(whole groups, live)``; None when the step trains nothing.

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
    stand_in: list[Sequence[Any]] = [[min(rows, key=lambda tr: len(tr.input_ids))]]
    mine = [(chunk, True) for chunk in shares[rank]]
    return mine + [(stand_in, False)] * (max(len(s) for s in shares) - len(mine))


def rl_batch(groups: Sequence[Sequence[Any]], image_dir: str, processor: Any, cfg: RLConfig) -> dict[str, torch.Tensor]:
    """Collate scored groups of ``Trajectory`` records and add the per-row GRPO fields.

    Rows that collate drops (longer than ``max_len`` under the ``drop`` policy) leave
    their group, so the group statistics use the rows that are actually trained.
    """
    from osvl.train.batch import collate

    keep: list[Any] = []
    group_ix: list[int] = []
    for g, trajs in enumerate(groups):
        for tr in trajs:
            if _trainable(tr, cfg):
                keep.append(tr)
                group_ix.append(g)
    batch = collate(keep, image_dir, processor, cfg.max_len, cfg.truncation)
    batch["reward"] = torch.tensor([tr.reward for tr in keep], dtype=torch.float32)
    batch["group"] = torch.tensor(group_ix, dtype=torch.long)
    batch["fatal"] = torch.tensor([tr.fatal_kth >= 0 for tr in keep], dtype=torch.bool)
    batch["mask_start"] = mask_starts([tr.fatal_cascade_start for tr in keep], [tr.fatal_kth for tr in keep],
                                      cfg.mask_at)
    return batch


def reference_model(model_dir: Any, cfg: RLConfig) -> torch.nn.Module | None:  # pragma: no mutate block
    """The frozen starting policy the KL term compares against; None when ``cfg.beta`` is 0 (no KL term)."""
    from osvl.models.load import load_model

    if cfg.beta <= 0:
        return None
    ref = load_model(model_dir, dtype="float32").eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def train_loop(config: dict[str, Any]) -> None:  # pragma: no mutate block
    """The Ray Train worker function: take a step's groups, update, publish, checkpoint; repeat.

    ``config`` (from the launcher, ``osvl/rl/trainer.py``): ``rl`` (RLConfig), ``model_dir``,
    ``image_dir`` and ``run`` (the run folder: checkpoints, per-step JSONL), all three as storage
    locations (``osvl.storage``), ``buffer`` and ``store`` (actor handles), ``steps`` (total),
    ``ckpt_every``, ``zero_stage``, ``threads``, ``weights_every``, ``temperature`` (the rollouts'
    sampling temperature).
    Every rank trains on its share of the step's groups (whole groups: the advantages
    are per group; ``rank_share``) over the step's global divisor, so any number of groups
    on any number of ranks gives the one-worker gradient (``Learner.step``).
    """
    import json

    import ray
    import torch.distributed as dist

    from osvl import storage
    from osvl.models.load import load_model, load_processor
    from osvl.rl import checkpoint as ckpt
    from osvl.rl.weights import publish
    from osvl.train.deepspeed import hf_state_dict

    cfg: RLConfig = config["rl"]
    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"] + rank)
    model_dir = storage.attach(config["model_dir"])  # a location: this node may hold no copy yet
    image_dir = storage.attach(config["image_dir"])
    # the run folder as this node sees it (the driver's mirror, or a fresh one on another node)
    run_folder = storage.attach(config["run"])
    ckpt_root, log_path = run_folder / "checkpoints", run_folder / "steps.jsonl"
    model = load_model(model_dir, dtype="float32")
    processor = load_processor(model_dir)
    ref = reference_model(model_dir, cfg)
    engine = make_engine(model, cfg, zero_stage=config["zero_stage"], world=world)
    learner = Learner(engine, cfg, ref_model=ref, temperature=config["temperature"])
    buffer, store = config["buffer"], config["store"]
    resume = ckpt.latest(ckpt_root)
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

    def push(version: int) -> float:
        state = hf_state_dict(engine)  # a collective under ZeRO-3: every rank calls it
        secs = publish(store, state, version) if rank == 0 else 0.0
        if rank == 0:
            ray.get(buffer.advance.remote(version))
        return secs

    sync_s = push(learner.step_count)
    if rank == 0:
        record_limits(config["recorder"], cfg, config["max_staleness"])
    log = open(log_path, "a") if rank == 0 else None  # noqa: SIM115 - closed below
    try:
        while learner.step_count + learner.skipped < config["steps"]:
            step = learner.step_count + learner.skipped
            t_wait = time.perf_counter()
            groups = ray.get(buffer.take.remote(step))
            wait_s = time.perf_counter() - t_wait
            share = rank_share(groups, rank, world, cfg)
            if share is not None:
                if any(not (image_dir / f"{sha}.png").is_file()
                       for chunk, _ in share for g in chunk for t in g for sha in t.images):
                    storage.refresh(image_dir)  # written by rollout actors on other nodes
                res = learner.step([(rl_batch(chunk, str(image_dir), processor, cfg), live) for chunk, live in share])
            else:  # every group of the step dropped: nothing to learn from, the step still counts
                learner.skipped += 1
                res = None
            if (step + 1) % config["weights_every"] == 0 or step + 1 == config["steps"]:
                sync_s = push(learner.step_count + learner.skipped)
            if (step + 1) % config["ckpt_every"] == 0 or step + 1 == config["steps"]:
                if world > 1:
                    dist.barrier()
                ckpt.save(engine, ckpt_root, step + 1, learner, buffer, processor, rank, world,
                          keep=config["keep"])
                if rank == 0:  # a run folder that mirrors remote storage: the checkpoint and the step log go there
                    storage.publish(run_folder, "checkpoints")
            if rank == 0:
                row = step_row(step, groups, res, wait_s, sync_s, ray.get(buffer.stats.remote()))
                log.write(json.dumps(row) + "\n")
                log.flush()
                storage.publish(run_folder, "steps.jsonl")
                record_metrics(config["recorder"], row, config["steps"])
                if (step + 1) % config["ckpt_every"] == 0 or step + 1 == config["steps"]:  # the last step is one
                    draw_curves(log_path)
    finally:
        if log is not None:
            log.close()


CURVES = "curves.png"  # the training curves, redrawn at each checkpoint (osvl/plots.py)
CURVE_PANELS = [("reward parts", ["reward", "r_fmt", "r_acc", "r_query"]), ("fatal rate", ["fatal_rate"]),
                ("clamp split (fatal rows)", ["clamped", "kept_positive"]), ("KL to the reference", ["kl"]),
                ("entropy", ["entropy"]), ("clip fraction", ["clip_fraction"])]


def draw_curves(log_path: Path) -> None:  # pragma: no mutate block
    """``curves.png`` beside the step log, published when the run folder mirrors remote storage."""
    from osvl import storage
    from osvl.plots import training_curves

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
    from osvl import metrics as M

    for name, value in (("kl_max", cfg.kl_max), ("entropy_min", cfg.entropy_min), ("entropy_max", cfg.entropy_max),
                        ("max_staleness", max_staleness)):
        rec.set(M.RL_LIMIT, value, limit=name)


def record_metrics(rec: Any, row: Mapping[str, Any], steps: int) -> None:  # pragma: no mutate block
    """Export a step's figures through Ray's metric API (specs in osvl/metrics.py) with the run's labels."""
    from osvl import metrics as M

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
