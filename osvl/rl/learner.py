"""The GRPO learner: one optimisation step on a batch of scored policy trajectories.

Two layers. ``grpo_loss`` turns per-token log-probs and a batch's per-row
fields into the fatal-aware loss of docs/design.md, by calling the pure math of
``osvl.agent.fatal`` / ``osvl.rl.loss`` in the one order the definition fixes:
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from osvl.agent.fatal import NOT_FATAL, MaskStart, mask_start
from osvl.config import opt
from osvl.errors import TrainingDiverged
from osvl.rl.loss import (
    MODES,
    LossOutput,
    apply_mode,
    group_advantages,
    loss_divisor,
    policy_loss,
    stats_members,
    token_mask,
)
from osvl.train import device
from osvl.train.batch import Truncation, model_inputs
from osvl.train.deepspeed import ds_config, init_engine


@dataclass
class RLConfig:
    """The fatal-aware GRPO knobs (defaults: docs/design.md's table)."""

    mode: Literal["vanilla", "hard_mask", "hard_mask_in_stats", "fatal_mask", "fatal_mask_clamp"] = opt(
        "fatal_mask_clamp", "Ablation mode (per-mode table in docs/design.md).")
    mask_at: MaskStart = opt(
        "cascade", "Where the token mask starts on a fatal trajectory: first failed step of the cascade "
        "(the paper's text, where masking 'commences', and its released code) or the K-th failure (a literal "
        "reading of the formula's fatal step).")
    group_size: int = opt(8, "G: samples per question; advantages are normalised within a group.")
    null_control: bool = opt(False, "A null control: each group's rewards move one sample on (sample i is scored "
                                    "with sample i-1's reward) before the advantages, so the updates are as large "
                                    "as a real run's and say nothing about which sample did better: what a GRPO "
                                    "gain has to beat.")
    baseline: Literal["grpo", "rloo"] = opt("grpo", "grpo: (r-mean)/(std+delta); rloo: leave-one-out mean (the "
                                                    "paper's configuration table).")
    eps_low: float = opt(0.2, "Lower clip of the importance ratio (1 - eps_low).")
    eps_high: float = opt(0.28, "Upper clip of the importance ratio (1 + eps_high).")
    beta: float = opt(0.001, "k3 KL coefficient to the frozen reference model; 0 disables the reference model.")
    aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"] = opt(
        "seq_mean_token_mean", "Loss aggregation: per-trajectory token mean then mean over G (paper); "
        "token_mean; seq_mean_token_sum (the paper's configuration table).")
    lr: float = opt(1e-5, "Adam learning rate.")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up over the first N learner steps (0 = none): Adam's "
                               "first step moves every weight by about lr whatever its gradient "
                               "(docs/measurements.md).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip (0 = off).")
    max_len: int = opt(4096, "Longest trajectory fed to the learner, in tokens (collate's truncation).")
    truncation: Truncation = opt("drop", "What collate does with a longer trajectory (see osvl/train/batch.py).")
    micro_tokens: int = opt(8192, "Most trainable tokens (padding excluded) in one learner forward/backward: a "
                                  "rank's groups are packed whole, by length, into micro-batches and their "
                                  "gradients accumulate into one update, so a step's activation memory is bounded "
                                  "by this budget, or by one group when a group is larger (0 = one batch per step).")
    kl_max: float = opt(0.0, "Stop the run when the mean k3 KL to the reference exceeds this (0 = no bound).")
    entropy_min: float = opt(0.0, "Stop the run when the mean token entropy falls below this (0 = no bound).")
    entropy_max: float = opt(0.0, "Stop the run when the mean token entropy exceeds this (0 = no bound).")


def mask_starts(fatal_cascade_start: Sequence[int], fatal_kth: Sequence[int], at: MaskStart) -> torch.Tensor:
    """Per-row turn index from which tokens get no gradient (``NOT_FATAL`` for non-fatal rows)."""
    return torch.tensor([mask_start(c, k, at) for c, k in zip(fatal_cascade_start, fatal_kth, strict=True)],
                        dtype=torch.long)


@dataclass
class StepLoss:
    out: LossOutput
    adv: torch.Tensor          # (B,) advantages after the mode (clamp applied)
    raw_adv: torch.Tensor      # (B,) normalised rewards before the clamp
    mask: torch.Tensor         # (B, T) the training mask M
    clamped: int               # fatal rows with a negative normalised reward (set to 0 where the mode clamps)
    kept_positive: int         # fatal rows with a positive normalised reward (kept)
    n_fatal: int


def _adv_and_mask(batch: Mapping[str, torch.Tensor], cfg: RLConfig,
                  live: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' normalised rewards, their advantages and loss weights after the mode, the (B, T) training
    mask M and the generated-token mask: everything of the loss that does not need the model."""
    mode = MODES[cfg.mode]
    # rl_batch's rows carry their normalised reward, computed over the whole group (a micro-batch may hold
    # part of one); a batch made by hand has its groups whole
    raw = batch["raw_adv"] if "raw_adv" in batch else group_advantages(
        batch["reward"], batch["group"], baseline=cfg.baseline, member=stats_members(batch["fatal"], cfg.mode))
    adv, weight = apply_mode(raw, batch["fatal"].to(torch.bool), cfg.mode)
    if not live:
        weight = torch.zeros_like(weight)
    start = batch["mask_start"] if mode.mask_post_fatal else torch.full_like(batch["mask_start"], NOT_FATAL)
    gen = batch["gen_mask"].to(torch.float32)
    return raw, adv, weight, token_mask(gen, batch["step_ids"], start), gen


def batch_divisor(batch: Mapping[str, torch.Tensor], cfg: RLConfig, live: bool = True) -> torch.Tensor:
    """What one micro-batch adds to its step's loss divisor (``loss_divisor``; 0 for a stand-in)."""
    if not live:
        return torch.zeros(())
    _, _, weight, mask, _ = _adv_and_mask(batch, cfg, live)
    return loss_divisor(mask, weight, cfg.aggregation).to(torch.float32)


def grpo_loss(logp: torch.Tensor, batch: Mapping[str, torch.Tensor], cfg: RLConfig,
              ref_logp: torch.Tensor | None = None, *, live: bool = True,
              divisor: torch.Tensor | None = None) -> StepLoss:
    """Fatal-aware GRPO loss of one batch (several whole groups may share it).

    ``batch`` holds (B, T) ``gen_mask``, ``step_ids``, ``old_logprobs`` and per-row
    ``reward``, ``group`` (group index), ``fatal`` (bool) and ``mask_start``.
    ``logp`` is (B, T), aligned with ``input_ids`` (log-prob of token t given < t).

    When the batch is one micro-batch of a step, or one rank's share, ``divisor`` is the
    step's (``batch_divisor`` summed over every micro-batch of every rank), so the parts' losses
    add up to the loss of the whole step in one batch. ``live=False`` marks a stand-in batch: it
    runs forward and backward (the collectives need every rank) with weight 0.
    """
    raw, adv, weight, mask, gen = _adv_and_mask(batch, cfg, live)
    out = policy_loss(logp, batch["old_logprobs"].to(logp.dtype), adv, mask, weight, eps_low=cfg.eps_low,
                      eps_high=cfg.eps_high, ref_logp=ref_logp, beta=cfg.beta, aggregation=cfg.aggregation,
                      gen_mask=gen, divisor=divisor)
    # the clamp split: fatal rows whose normalised reward is negative (the clamp sets them to 0) vs
    # positive (kept); counted in every mode, so the ablations report what the clamp would do
    fatal = batch["fatal"].to(torch.bool) & live  # a stand-in batch counts nothing
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
    return device.world()


def _sum_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (``t`` itself on one), on the process group's device."""
    return device.all_reduce(t)


def _all_ranks(ok: bool) -> bool:
    """``ok`` on every rank (a skip must be unanimous, or the ranks' collectives would deadlock)."""
    return int(device.all_reduce(torch.tensor([0 if ok else 1], dtype=torch.int32), op="max")) == 0


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
    at = scored_positions(batch["gen_mask"])
    keep = torch.nn.functional.pad(at[:, 1:], (0, 1), value=False)  # logits at t predict token t + 1
    inputs = device.to_model({**model_inputs(batch), "logits_to_keep": keep}, model)
    logits = model(**inputs, use_cache=False).logits.float()
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


def learner_ds_config(cfg: RLConfig, *, zero_stage: int = 2, world: int = 1, bf16: bool = False,
                      hidden_size: int = 0, on_gpu: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a learner rank (``make_engine``; ``load_trainable`` builds the model by it)."""
    return ds_config(zero_stage, micro_batch=1, grad_accum=1, world_size=world, grad_clip=cfg.grad_clip, bf16=bf16,
                     hidden_size=hidden_size, on_gpu=on_gpu)


def make_engine(model: torch.nn.Module, cfg: RLConfig, *, zero_stage: int = 2, world: int = 1,
                optimizer: torch.optim.Optimizer | None = None, config: dict[str, Any] | None = None) -> Any:
    """The DeepSpeed engine a learner rank steps: AdamW (or ``optimizer``) under the ``rl.warmup_steps``
    schedule, ZeRO ``zero_stage`` (or the whole DeepSpeed ``config``, ``learner_ds_config``); ``Learner.step``
    marks its own accumulation boundary, so a step may have any number of micro-batches. Outside Ray
    Train (tests) it makes a one-process group first, so a test runs the learner exactly as a
    one-worker job does."""
    opt_ = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                          weight_decay=cfg.weight_decay)
    return init_engine(model, opt_, warmup_schedule(opt_, cfg.warmup_steps),
                       config or learner_ds_config(cfg, zero_stage=zero_stage, world=world))


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

    def step(self, micro: Sequence[tuple[Mapping[str, torch.Tensor], bool]]) -> StepResult:
        """One update on this rank's share of a step: its micro-batches (``rank_share``: whole groups,
        each ``(batch, live)``; ``live=False`` is a stand-in), gradients accumulated over them.

        Every micro-batch's loss is over the step's global divisor, so the losses add up to the
        loss of the whole step in one batch, and under DeepSpeed with several ranks it is multiplied
        by the world size, because DeepSpeed *averages* the ranks' gradients: the sum is then the
        gradient one worker would compute on the whole step in one batch, however the groups were
        split. The loss, KL and entropy reported are the step's (summed over micro-batches and ranks).
        A non-finite loss or gradient on any rank skips the update on all of them (every
        micro-batch still runs backward, so the ranks' collectives stay paired).
        """
        t0, c0 = time.perf_counter(), time.process_time()
        self.model.train()
        world = _world()
        divisor = _sum_ranks(sum((batch_divisor(b, self.cfg, live) for b, live in micro), torch.zeros(())))
        # the step's loss, policy loss, KL, entropy x tokens, tokens; this rank's clipped, trained, generated tokens
        totals = torch.zeros(5, dtype=torch.float64)
        clipped = trained = generated = 0.0
        clamped = kept = n_fatal = tokens = 0
        finite = True
        for i, (batch, live) in enumerate(micro):
            batch = device.to_model(batch, self.engine)  # the one move: model inputs and loss fields alike
            # DeepSpeed reduces and the optimiser may step only after the last micro-batch
            self.engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            logp, logits = forward_logprobs(self.engine, batch, self.temperature)
            ref_logp = None
            if self.ref is not None and self.cfg.beta > 0:
                with torch.no_grad():
                    ref_logp, _ = forward_logprobs(self.ref, batch, self.temperature)
            sl = grpo_loss(logp, batch, self.cfg, ref_logp, live=live, divisor=divisor)
            rows = sl.mask[scored_positions(batch["gen_mask"])]  # logits' rows, in order
            n = float(rows.sum()) if live else 0.0
            totals += torch.tensor([float(sl.out.loss.detach()), float(sl.out.policy_loss), float(sl.out.kl),
                                    token_entropy(logits, rows) * n, n], dtype=torch.float64)
            m, g = float(sl.mask.sum()), int(batch["gen_mask"].sum())
            clipped += float(sl.out.clip_fraction) * m
            trained += m
            generated += g
            clamped, kept, n_fatal = clamped + sl.clamped, kept + sl.kept_positive, n_fatal + sl.n_fatal
            tokens += g if live else 0
            finite = finite and bool(torch.isfinite(sl.out.loss))
            self.engine.backward(sl.out.loss * world)
        reported = _sum_ranks(totals)
        entropy = float(reported[3] / reported[4]) if reported[4] > 0 else 0.0
        finite = _all_ranks(finite) and not _overflow(self.engine, self.params)
        grad_norm = float("nan")
        if finite:
            self.engine.step()
            grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
            self.step_count += 1
        else:
            self.engine.optimizer.zero_grad()
            self.skipped += 1
        kl = float(reported[2])
        if finite:
            check_bounds(self.cfg, kl, entropy, self.step_count)
        return StepResult(step=self.step_count, skipped=not finite, loss=float(reported[0]),
                          policy_loss=float(reported[1]), kl=kl, clip_fraction=clipped / max(trained, 1.0),
                          mask_coverage=trained / max(generated, 1.0), entropy=entropy, grad_norm=grad_norm,
                          clamped=clamped, kept_positive=kept, n_fatal=n_fatal, tokens=tokens,
                          seconds=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
