"""Fatal-aware GRPO as pure tensor functions: the token mask, group advantages, the clamp, the loss.

The precise math is docs/design.md's "Fatal-aware GRPO". For a group of G
trajectories of one question:

    r_i   = r_fmt,i · (α·r_acc,i + (1−α)·r_query,i)      r_acc = 0 when fatal
    r̃_i   = (r_i − mean_G r) / (std_G r + δ)             over all G, fatal included (``hard_mask``:
                                                         over the non-fatal members only, the paper's)
    Â_i   = r̃_i, or max(r̃_i, 0) for a fatal i            (the one-sided clamp)
    J     = Σ_i w_i (1/Σ_t M_it) Σ_t M_it · min(ρ Â, clip(ρ, 1−ε_low, 1+ε_high) Â) − β·KL_k3

with w_i = 1/G (the paper's aggregation). The reward r_i is computed once, per trajectory,
by ``osvl.agent.reward.score_trajectory``; the mask M starts at the turn
``osvl.agent.fatal.mask_start`` names. The four ablation modes differ only
in four switches (``MODES``): whether post-fatal tokens are masked, whether a
fatal trajectory is dropped from the loss, whether it still counts in the group
statistics, and whether the clamp is applied. Keeping them as data makes the per-mode
table testable. ``hard_mask`` is the paper's hard mask: a fatal trajectory is
discarded, from the group's mean and std as well as from the loss;
``hard_mask_in_stats`` (osvl's earlier ``hard_mask``) drops it from the loss only, so it
still shapes the baseline the others are judged against.

Shapes: B trajectories (several groups may share a batch), T tokens. ``group``
is a (B,) long tensor of group ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mode:
    mask_post_fatal: bool
    drop_fatal: bool
    clamp_fatal: bool
    fatal_in_stats: bool = True  # False: group mean/std over the non-fatal members only


MODES: dict[str, Mode] = {
    "vanilla": Mode(mask_post_fatal=False, drop_fatal=False, clamp_fatal=False),
    "hard_mask": Mode(mask_post_fatal=False, drop_fatal=True, clamp_fatal=False, fatal_in_stats=False),
    "hard_mask_in_stats": Mode(mask_post_fatal=False, drop_fatal=True, clamp_fatal=False),
    "fatal_mask": Mode(mask_post_fatal=True, drop_fatal=False, clamp_fatal=False),
    "fatal_mask_clamp": Mode(mask_post_fatal=True, drop_fatal=False, clamp_fatal=True),
}

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum")


def token_mask(gen_mask: torch.Tensor, step_ids: torch.Tensor, mask_start: torch.Tensor) -> torch.Tensor:
    """M = M_gen · 1[step(t) < f]: model tokens of turns before the mask start.

    gen_mask: (B, T) 1 on model-generated tokens; step_ids: (B, T) the assistant-turn
    index each token belongs to (any value on prompt/tool tokens, which gen_mask
    zeroes anyway); mask_start: (B,) the turn index from which gradient stops
    (``osvl.agent.fatal.mask_start``: ``NOT_FATAL`` for trajectories without a fatal step).
    """
    keep = step_ids < mask_start.unsqueeze(1)
    return gen_mask.to(torch.float32) * keep.to(torch.float32)


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, baseline: str = "grpo",
                     eps: float = 1e-6, unbiased: bool = True, member: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised advantages within each group.

    ``grpo``: (r − mean)/(std + δ) with the unbiased std by default. ``rloo``: r minus
    the mean of the *other* members (leave-one-out, as the paper's configuration table
    lists it). A singleton group gets advantage 0 (no comparison is
    possible), and a group of identical rewards gets 0 everywhere (std 0, numerator 0).
    ``member`` (B,) bool, when given, says which rows the statistics are over (``stats_members``);
    the others get advantage 0.
    """
    if baseline not in ("grpo", "rloo"):
        raise ValueError(f"baseline must be 'grpo' or 'rloo', got {baseline!r}")
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    if member is not None:
        group = torch.where(member.to(torch.bool), group, torch.full_like(group, -1))
    for g in torch.unique(group):
        if member is not None and g < 0:
            continue
        idx = (group == g).nonzero(as_tuple=True)[0]
        r = rewards[idx].to(torch.float32)
        n = r.numel()
        if n == 1:
            continue
        if baseline == "grpo":
            std = r.std(unbiased=unbiased)
            adv[idx] = (r - r.mean()) / (std + eps)
        else:
            adv[idx] = r - (r.sum() - r) / (n - 1)
    return adv


def stats_members(fatal: torch.Tensor, mode: str) -> torch.Tensor | None:
    """The rows a mode's group statistics are over: all (None) or, for the paper's ``hard_mask``, the
    non-fatal ones."""
    return None if MODES[mode].fatal_in_stats else ~fatal.to(torch.bool)


def apply_mode(adv: torch.Tensor, fatal: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory (advantage, loss weight multiplier) after the group statistics.

    The clamp and the drop come *after* normalisation over all G, so fatal
    trajectories still shape the baseline that the others are judged against.
    """
    m = MODES[mode]
    weight = torch.ones_like(adv)
    if m.clamp_fatal:
        adv = torch.where(fatal, adv.clamp(min=0.0), adv)
    if m.drop_fatal:
        weight = torch.where(fatal, torch.zeros_like(weight), weight)
    return adv, weight


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's low-variance, non-negative KL estimator: exp(r) − r − 1 with r = ref − logp."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0


@dataclass
class LossOutput:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    mask_coverage: torch.Tensor  # share of generated tokens that receive gradient


def loss_divisor(mask: torch.Tensor, weight: torch.Tensor, how: str) -> torch.Tensor:
    """What a batch contributes to the divisor of ``_aggregate``: its rows (the sequence
    aggregations) or its weighted trained tokens (``token_mean``). A learner split over ranks sums
    this over every rank, so that each rank's share of the loss is over the *global* divisor."""
    if how == "token_mean":
        return (mask * weight.unsqueeze(1)).sum()
    return torch.tensor(float(mask.shape[0]))


def _aggregate(x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, how: str,
               divisor: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a (B, T) per-token quantity to a scalar; an all-masked trajectory contributes 0.

    The divisor of the sequence aggregations is B (1/G per group, averaged over
    equal-sized groups), *not* the number of surviving trajectories: dropping or
    fully masking a trajectory must not scale up the others' gradients. ``divisor``
    replaces the batch's own (``loss_divisor``) when the batch is one rank's share of a step.
    """
    div = (loss_divisor(mask, weight, how) if divisor is None else divisor).clamp(min=1.0)
    if how == "token_mean":
        return (x * mask * weight.unsqueeze(1)).sum() / div
    tok_sum = (x * mask).sum(dim=1)
    if how == "seq_mean_token_mean":
        per_traj = tok_sum / mask.sum(dim=1).clamp(min=1.0)
    elif how == "seq_mean_token_sum":
        per_traj = tok_sum
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    return (per_traj * weight).sum() / div


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                weight: torch.Tensor | None = None, *, eps_low: float = 0.2, eps_high: float = 0.28,
                ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                aggregation: str = "seq_mean_token_mean", gen_mask: torch.Tensor | None = None,
                divisor: torch.Tensor | None = None) -> LossOutput:
    """The clipped surrogate (to *minimise*: the negative of J) with optional k3 KL.

    logp: (B, T) current policy log-probs of the taken tokens; old_logp: the
    behaviour log-probs recorded at rollout (the importance ratio uses them, not a
    recomputation); adv: (B,); mask: (B, T) the training mask M; weight: (B,) loss
    weight from ``apply_mode`` (zeros drop a trajectory); divisor: the global one of a
    step split over ranks (``loss_divisor`` summed over them), else the batch's own.
    """
    mask = mask.to(torch.float32)
    weight = torch.ones_like(adv) if weight is None else weight
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(1)
    surr = torch.minimum(ratio * a, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * a)
    pg = -_aggregate(surr, mask, weight, aggregation, divisor)
    if ref_logp is not None and beta > 0:
        kl = _aggregate(kl_k3(logp, ref_logp), mask, weight, aggregation, divisor)
    else:
        kl = torch.zeros((), dtype=logp.dtype)
    clipped = ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).to(torch.float32)
    with torch.no_grad():
        clip_frac = (clipped * mask).sum() / mask.sum().clamp(min=1.0)
        gm = mask if gen_mask is None else gen_mask.to(torch.float32)
        coverage = mask.sum() / gm.sum().clamp(min=1.0)
    return LossOutput(loss=pg + beta * kl, policy_loss=pg.detach(), kl=kl.detach(), clip_fraction=clip_frac,
                      mask_coverage=coverage)
