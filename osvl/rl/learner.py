"""The GRPO learner: one optimisation step on a batch of scored policy trajectories.

Two layers. ``grpo_loss`` turns per-token log-probs and a batch's per-row
fields into the fatal-aware loss of docs/design.md, by calling the pure math of
``osvl.rl.fatal`` / ``osvl.rl.loss`` in the one order the definition fixes:
group statistics over all G first, then the mode's clamp/drop, then the token
mask. ``Learner`` owns the DeepSpeed engine (model and optimiser; the same engine on
one rank in tests as in a one-worker job) and the frozen reference model, and adds
the guards: a non-finite loss or gradient skips the step (counted), KL or entropy
outside the configured bounds stops the run with ``TrainingDiverged``.

Why the ratio uses the *recorded* behaviour log-probs: with ``max_staleness > 0``
the rollout weights lag the learner's, and the recorded values are the only exact
record of the distribution that sampled the tokens (recomputing them with the
learner's weights would make every ratio 1 and silently turn off the correction).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from osvl.config import opt
from osvl.errors import TrainingDiverged
from osvl.rl.fatal import NOT_FATAL, token_mask
from osvl.rl.loss import MODES, LossOutput, apply_mode, group_advantages, loss_divisor, policy_loss


@dataclass
class RLConfig:
    """The fatal-aware GRPO knobs (defaults: docs/design.md's table)."""

    mode: Literal["vanilla", "hard_mask", "fatal_mask", "fatal_mask_clamp"] = opt(
        "fatal_mask_clamp", "Ablation mode (per-mode table in docs/design.md).")
    mask_at: Literal["cascade", "kth"] = opt(
        "cascade", "Where the token mask starts on a fatal trajectory: first failed step of the cascade "
        "(released code) or the K-th failure (paper's formula).")
    group_size: int = opt(8, "G: samples per question; advantages are normalised within a group.")
    baseline: Literal["grpo", "rloo"] = opt("grpo", "grpo: (r-mean)/(std+delta); rloo: leave-one-out mean.")
    eps_low: float = opt(0.2, "Lower clip of the importance ratio (1 - eps_low).")
    eps_high: float = opt(0.28, "Upper clip of the importance ratio (1 + eps_high).")
    beta: float = opt(0.001, "k3 KL coefficient to the frozen reference model; 0 disables the reference model.")
    aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"] = opt(
        "seq_mean_token_mean", "Loss aggregation: per-trajectory token mean then mean over G (paper); "
        "token_mean; seq_mean_token_sum (released code).")
    lr: float = opt(1e-5, "Adam learning rate.")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up over the first N learner steps (0 = none). Adam's "
                               "first step moves every weight by about lr whatever its gradient; on the demo's "
                               "tiny policy at lr 3e-4 that spiked the KL to the reference to 2.9 at step 2.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip (0 = off).")
    max_len: int = opt(4096, "Longest trajectory fed to the learner, in tokens (collate's truncation).")
    truncation: str = opt("drop", "What collate does with a longer trajectory (see osvl/train/batch.py).")
    kl_max: float = opt(0.0, "Stop the run when the mean k3 KL to the reference exceeds this (0 = no bound).")
    entropy_min: float = opt(0.0, "Stop the run when the mean token entropy falls below this (0 = no bound).")
    entropy_max: float = opt(0.0, "Stop the run when the mean token entropy exceeds this (0 = no bound).")


def mask_starts(fatal_cascade_start: Sequence[int], fatal_kth: Sequence[int], at: str) -> torch.Tensor:
    """Per-row turn index from which tokens get no gradient (``NOT_FATAL`` for non-fatal rows)."""
    src = fatal_cascade_start if at == "cascade" else fatal_kth
    return torch.tensor([NOT_FATAL if s < 0 else s for s in src], dtype=torch.long)


@dataclass
class StepLoss:
    out: LossOutput
    adv: torch.Tensor          # (B,) advantages after the mode (clamp applied)
    raw_adv: torch.Tensor      # (B,) normalised rewards before the clamp
    mask: torch.Tensor         # (B, T) the training mask M
    clamped: int               # fatal rows with a negative normalised reward (set to 0 where the mode clamps)
    kept_positive: int         # fatal rows with a positive normalised reward (kept)
    n_fatal: int


def grpo_loss(logp: torch.Tensor, batch: Mapping[str, torch.Tensor], cfg: RLConfig,
              ref_logp: torch.Tensor | None = None, *, live: bool = True,
              global_divisor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepLoss:
    """Fatal-aware GRPO loss of one batch (several groups may share it).

    ``batch`` holds (B, T) ``gen_mask``, ``step_ids``, ``old_logprobs`` and per-row
    ``reward``, ``group`` (group index), ``fatal`` (bool) and ``mask_start``.
    ``logp`` is (B, T), aligned with ``input_ids`` (log-prob of token t given < t).

    When the batch is one rank's share of a step, ``global_divisor`` maps this batch's
    divisor (``loss_divisor``) to the step's (a sum over the ranks), so the ranks' losses add
    up to the loss one worker would compute on the whole step. ``live=False`` marks a stand-in
    batch: it runs forward and backward (the collectives need every rank) with weight 0 and
    adds nothing to the divisor.
    """
    mode = MODES[cfg.mode]
    fatal = batch["fatal"].to(torch.bool)
    raw = group_advantages(batch["reward"], batch["group"], baseline=cfg.baseline)
    adv, weight = apply_mode(raw, fatal, cfg.mode)
    if not live:
        weight = torch.zeros_like(weight)
    start = batch["mask_start"] if mode.mask_post_fatal else torch.full_like(batch["mask_start"], NOT_FATAL)
    gen = batch["gen_mask"].to(torch.float32)
    mask = token_mask(gen, batch["step_ids"], start)
    divisor = None
    if global_divisor is not None:
        local = loss_divisor(mask, weight, cfg.aggregation) if live else torch.zeros(())
        divisor = global_divisor(local.to(torch.float32))
    out = policy_loss(logp, batch["old_logprobs"].to(logp.dtype), adv, mask, weight, eps_low=cfg.eps_low,
                      eps_high=cfg.eps_high, ref_logp=ref_logp, beta=cfg.beta, aggregation=cfg.aggregation,
                      gen_mask=gen, divisor=divisor)
    # the clamp split: fatal rows whose normalised reward is negative (the clamp sets them to 0) vs
    # positive (kept); counted in every mode, so the ablations report what the clamp would do
    fatal = fatal & live  # a stand-in batch counts nothing
    clamped = int((fatal & (raw < 0)).sum())
    kept = int((fatal & (raw > 0)).sum())  # a 0 advantage is neither
    return StepLoss(out=out, adv=adv, raw_adv=raw, mask=mask, clamped=clamped, kept_positive=kept,
                    n_fatal=int(fatal.sum()))


def token_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy of the next-token distributions of the (N, V) ``logits`` rows where ``mask`` (N,)
    is set (a collapse detector)."""
    with torch.no_grad():
        rows = logits[mask.to(torch.bool)].float()
        if rows.numel() == 0:
            return 0.0
        logp = torch.log_softmax(rows, dim=-1)
        return float(-(logp.exp() * logp).sum(-1).mean())


def check_bounds(cfg: RLConfig, kl: float, entropy: float, step: int) -> None:
    """Stop the run when KL or entropy leave their bounds: a clear message instead of a silent collapse."""
    if cfg.kl_max > 0 and kl > cfg.kl_max:
        raise TrainingDiverged(f"step {step}: KL to the reference {kl:.4g} exceeds rl.kl_max={cfg.kl_max}; "
                               "lower rl.lr or raise rl.beta, then resume from the last checkpoint")
    if cfg.entropy_min > 0 and entropy < cfg.entropy_min:
        raise TrainingDiverged(f"step {step}: token entropy {entropy:.4g} fell below rl.entropy_min="
                               f"{cfg.entropy_min} (policy collapse); resume from an earlier checkpoint")
    if cfg.entropy_max > 0 and entropy > cfg.entropy_max:
        raise TrainingDiverged(f"step {step}: token entropy {entropy:.4g} exceeds rl.entropy_max="
                               f"{cfg.entropy_max}; the policy is diverging")


def _world() -> int:
    """Ranks in the process group (1 without one: tests, the single-process learner)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sum_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (``t`` itself on one)."""
    import torch.distributed as dist

    if _world() == 1:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _all_ranks(ok: bool) -> bool:
    """``ok`` on every rank (a skip must be unanimous, or the ranks' collectives would deadlock)."""
    import torch.distributed as dist

    if _world() == 1:
        return ok
    t = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) == 0


def _overflow(engine: Any, params: Sequence[torch.nn.Parameter]) -> bool:
    """Non-finite gradients after ``engine.backward``: ZeRO keeps them in its partitions (its own
    all-reduced check); without ZeRO they are on the parameters."""
    check = getattr(engine.optimizer, "has_overflow", None)
    if check is not None:
        return bool(check())
    return not _all_ranks(all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params))


def scored_positions(gen_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the tokens whose log-prob the learner computes (generated ones; the first token has
    no context)."""
    at = gen_mask.to(torch.bool).clone()
    at[:, 0] = False
    return at


def forward_logprobs(model: torch.nn.Module, batch: Mapping[str, torch.Tensor],
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs of the generated tokens given the ones before (0 elsewhere) and their (N, V) logits.

    Only generated tokens (``gen_mask``) can carry loss, so logits are computed only at
    the N positions that predict one (``logits_to_keep`` as a boolean mask: the LM head
    and the log-softmax run on those rows alone, in row-major order of ``gen_mask``).
    On agent trajectories that is about 15% of the positions: the system prompt, the
    question, tool responses and image tokens make up the rest. Measured on the GRPO
    benchmark's batches (8 x 790 tokens, 1,019 generated): 2.02 -> 1.35 CPU-seconds per
    learner step, and no (B, T, V) logits tensor in memory.
    """
    from osvl.train.batch import model_inputs

    at = scored_positions(batch["gen_mask"])
    keep = torch.nn.functional.pad(at[:, 1:], (0, 1), value=False)  # logits at t predict token t + 1
    logits = model(**model_inputs(batch), use_cache=False, logits_to_keep=keep).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    target = batch["input_ids"][at]
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.zeros(at.shape, dtype=picked.dtype, device=picked.device).masked_scatter(at, picked), logits


def warmup_schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``rl.warmup_steps``: the learning rate rises linearly over the first ``steps`` optimiser steps,
    then stays (0 = constant from the start). A LambdaLR, so DeepSpeed checkpoints save its position."""
    warm = max(1, steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))


@dataclass
class StepResult:
    step: int
    skipped: bool
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    mask_coverage: float
    entropy: float
    grad_norm: float
    clamped: int
    kept_positive: int
    n_fatal: int
    tokens: int
    seconds: float
    cpu_s: float               # this process's CPU time in the step: below ``seconds`` when cores are shared


def make_engine(model: torch.nn.Module, cfg: RLConfig, *, zero_stage: int = 2, world: int = 1,
                optimizer: torch.optim.Optimizer | None = None) -> Any:
    """The DeepSpeed engine a learner rank steps: AdamW (or ``optimizer``) under the ``rl.warmup_steps``
    schedule, ZeRO ``zero_stage``, one micro-batch per step. Outside Ray Train (tests) it makes a
    one-process group first, so a test runs the learner exactly as a one-worker job does."""
    from osvl.train.deepspeed import ds_config, init_engine

    opt_ = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                          weight_decay=cfg.weight_decay)
    return init_engine(model, opt_, warmup_schedule(opt_, cfg.warmup_steps),
                       ds_config(zero_stage, micro_batch=1, grad_accum=1, world_size=world, grad_clip=cfg.grad_clip))


class Learner:
    """A DeepSpeed engine (``make_engine``) + optional frozen reference; ``step(batch)`` is one GRPO update.

    ``temperature`` is the rollouts' sampling temperature: the behaviour log-probs are those
    of the tempered distribution, so the current (and reference) log-probs must be too, or
    the importance ratio is off before the first update. At 0.7 with T=1 log-probs, 31% of
    the demo's first-step tokens were clipped and the clip kept exactly the updates that
    sharpen the policy (ratio < 1 on likely tokens passes positive advantages only, ratio > 1
    on unlikely tokens negative ones only): entropy 1.7 -> 0.2 in 10 steps.
    """

    def __init__(self, engine: Any, cfg: RLConfig, *, ref_model: torch.nn.Module | None = None,
                 temperature: float = 1.0) -> None:
        self.engine, self.model, self.cfg, self.ref = engine, engine.module, cfg, ref_model
        self.temperature = temperature
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.step_count = 0      # optimiser steps applied (the policy version)
        self.skipped = 0         # non-finite steps skipped

    def step(self, batch: Mapping[str, torch.Tensor], live: bool = True) -> StepResult:
        """One update on this rank's share of a step (see ``rank_share``; ``live=False``: a stand-in).

        Under DeepSpeed with several ranks the loss is over the step's global divisor and
        multiplied by the world size, because DeepSpeed *averages* the ranks' gradients: the
        sum is then the gradient one worker would compute on the whole step, however the
        groups were split. The loss and KL reported are the step's (summed over the ranks).
        """
        t0, c0 = time.perf_counter(), time.process_time()
        self.model.train()
        logp, logits = forward_logprobs(self.engine, batch, self.temperature)
        ref_logp = None
        if self.ref is not None and self.cfg.beta > 0:
            with torch.no_grad():
                ref_logp, _ = forward_logprobs(self.ref, batch, self.temperature)
        world = _world()
        sl = grpo_loss(logp, batch, self.cfg, ref_logp, live=live,
                       global_divisor=_sum_ranks if world > 1 else None)
        rows = sl.mask[scored_positions(batch["gen_mask"])]  # logits' rows, in order
        entropy = token_entropy(logits, rows)
        loss = sl.out.loss * world
        # the step's loss, KL and token-weighted entropy, the same on every rank (so are the bound checks)
        n = float(rows.sum()) if live else 0.0
        reported = _sum_ranks(torch.tensor([float(sl.out.loss.detach()), float(sl.out.policy_loss), float(sl.out.kl),
                                            entropy * n, n], dtype=torch.float64))
        entropy = float(reported[3] / reported[4]) if reported[4] > 0 else entropy
        finite = _all_ranks(bool(torch.isfinite(loss)))
        grad_norm = float("nan")
        if finite:
            self.engine.backward(loss)
            finite = not _overflow(self.engine, self.params)
        if finite:
            self.engine.step()
            grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
        else:
            self.engine.optimizer.zero_grad()
        if finite:
            self.step_count += 1
        else:
            self.skipped += 1
        kl = float(reported[2])
        if finite:
            check_bounds(self.cfg, kl, entropy, self.step_count)
        return StepResult(step=self.step_count, skipped=not finite, loss=float(reported[0]),
                          policy_loss=float(reported[1]), kl=kl, clip_fraction=float(sl.out.clip_fraction),
                          mask_coverage=float(sl.out.mask_coverage), entropy=entropy, grad_norm=grad_norm,
                          clamped=sl.clamped, kept_positive=sl.kept_positive, n_fatal=sl.n_fatal,
                          tokens=int(batch["gen_mask"].sum()), seconds=time.perf_counter() - t0,
                          cpu_s=time.process_time() - c0)


# ---------------------------------------------------------------------------
# batches and the Ray Train worker loop


def _trainable(tr: Any, cfg: RLConfig) -> bool:
    """Whether ``rl_batch`` keeps the record (the ``drop`` policy drops rows over ``max_len``)."""
    return len(tr.input_ids) <= cfg.max_len or cfg.truncation != "drop"


def rank_share(groups: Sequence[Sequence[Any]], rank: int, world: int,
               cfg: RLConfig) -> tuple[list[Sequence[Any]], bool] | None:
    """This rank's whole groups of a step and whether they are live; None when the step trains nothing.

    Every rank sees the step's full list of groups, so each decides the same thing without
    a collective. A rank left without a trainable row (fewer groups than ranks, or all its
    rows dropped for length) still has to join every collective of the step (DeepSpeed's
    gradient reduction, the divisor's sum), so it gets a stand-in: the step's shortest
    trainable record, trained with weight 0 (``live=False``). When no row of the step is
    trainable, every rank skips it together.
    """
    mine = list(groups[rank::world])
    if any(_trainable(tr, cfg) for g in mine for tr in g):
        return mine, True
    rows = [tr for g in groups for tr in g if _trainable(tr, cfg)]
    if not rows:
        return None
    return [[min(rows, key=lambda tr: len(tr.input_ids))]], False


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


def train_loop(config: dict[str, Any]) -> None:
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
    ref = None
    if cfg.beta > 0:
        ref = load_model(model_dir, dtype="float32").eval()
        for p in ref.parameters():
            p.requires_grad_(False)
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
                if any(not (image_dir / f"{sha}.png").is_file() for g in share[0] for t in g for sha in t.images):
                    storage.refresh(image_dir)  # written by rollout actors on other nodes
                batch = rl_batch(share[0], str(image_dir), processor, cfg)
                res = learner.step(batch, live=share[1])
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


def draw_curves(log_path: Path) -> None:
    """``curves.png`` beside the step log, published when the run folder mirrors remote storage."""
    from osvl import storage
    from osvl.plots import training_curves

    training_curves(log_path, CURVE_PANELS, log_path.parent / CURVES, title=f"GRPO {log_path.parent.name}")
    storage.publish(log_path.parent, CURVES)


def step_row(step: int, groups: Sequence[Sequence[Any]], res: StepResult | None, wait_s: float, sync_s: float,
             buffer_stats: dict[str, Any]) -> dict[str, Any]:
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
        "dropped": buffer_stats["dropped"], "staleness": buffer_stats["staleness"],
        "versions": sorted({t.policy_version for tr in trajs for t in tr.turns}),
        "group_ids": sorted({t.group_id for t in trajs}),
    }
    if res is not None:
        row.update(loss=res.loss, kl=res.kl, clip_fraction=res.clip_fraction, entropy=res.entropy,
                   mask_coverage=res.mask_coverage, grad_norm=res.grad_norm, skipped=res.skipped,
                   clamped=res.clamped, kept_positive=res.kept_positive, step_s=res.seconds, step_cpu_s=res.cpu_s,
                   tokens_per_s=res.tokens / max(res.seconds, 1e-9))
    return row


def record_limits(rec: Any, cfg: RLConfig, max_staleness: int) -> None:
    """Export the run's bounds once, so alert rules compare KL, entropy and staleness against them."""
    from osvl import metrics as M

    for name, value in (("kl_max", cfg.kl_max), ("entropy_min", cfg.entropy_min), ("entropy_max", cfg.entropy_max),
                        ("max_staleness", max_staleness)):
        rec.set(M.RL_LIMIT, value, limit=name)


def record_metrics(rec: Any, row: Mapping[str, Any], steps: int) -> None:
    """Export a step's figures through Ray's metric API (specs in osvl/metrics.py) with the run's labels."""
    from osvl import metrics as M

    if row["trajectories"]:  # a step whose groups were all dropped has no rates: a 0 would be a false dip
        for part in ("reward", "r_fmt", "r_acc", "r_query"):
            rec.set(M.RL_REWARD, row[part], part=part)
        rec.set(M.RL_ACCURACY, row["accuracy"])
        rec.set(M.RL_FATAL_RATE, row["fatal_rate"])
    rec.set(M.RL_BUFFER_DEPTH, row["buffer_ready"])
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
