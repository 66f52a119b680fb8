"""Fatal-aware GRPO math against hand-computed values (docs/design.md, per-mode table)."""

from __future__ import annotations

import math

import pytest
import torch

from osvl.agent.fatal import NOT_FATAL, Fatal, find_fatal, mask_start
from osvl.errors import ConfigError
from osvl.rl.loss import MODES, apply_mode, group_advantages, kl_k3, policy_loss, token_mask

T, F = True, False


@pytest.mark.parametrize("failed, k, expected", [
    ([F, T, T, T], 3, Fatal(1, 3)),
    ([T, T, F, T, T, T], 3, Fatal(3, 5)),   # a success in between resets the count
    ([T, T, F, T, T], 3, None),
    ([], 3, None),
    ([F, T], 1, Fatal(1, 1)),
    ([T, T, T, T, T], 3, Fatal(0, 2)),      # the first cascade wins
])
def test_find_fatal(failed, k, expected):
    assert find_fatal(failed, k) == expected


def test_mask_start_modes():
    assert mask_start(2, 4, "cascade") == 2 and mask_start(2, 4, "kth") == 4
    assert mask_start(-1, -1, "cascade") == NOT_FATAL == mask_start(-1, -1, "kth")
    with pytest.raises(ConfigError, match="mask start"):
        mask_start(2, 4, "nope")
    with pytest.raises(ConfigError):
        find_fatal([T], 0)


def test_token_mask():
    gen = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 1]])
    step = torch.tensor([[-1, 0, 0, 0, 1, 1], [-1, 0, 0, 0, 1, 1]])
    m = token_mask(gen, step, torch.tensor([1, NOT_FATAL]))
    assert m.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 1]]


ADV_CASES = [
    # rewards, groups, baseline, expected advantages
    ([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], "grpo", [0.8660254, -0.8660254, -0.8660254, 0.8660254]),
    ([0.7], [0], "grpo", [0.0]),                                    # singleton group
    ([0.5, 0.5, 0.5], [0, 0, 0], "grpo", [0.0, 0.0, 0.0]),          # identical rewards
    ([1.0, 0.0, 0.0], [0, 0, 0], "rloo", [1.0, -0.5, -0.5]),
    ([1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1], "grpo", [0.7071063, -0.7071063, 0.0, 0.0]),  # two groups
]


@pytest.mark.parametrize("rewards, groups, baseline, expected", ADV_CASES)
def test_group_advantages(rewards, groups, baseline, expected):
    adv = group_advantages(torch.tensor(rewards), torch.tensor(groups), baseline=baseline)
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


CLAMP_CASES = [
    # rewards, fatal flags, expected Â under fatal_mask_clamp
    # negative normalised fatal rewards are clamped to 0 (mean .3, unbiased std .476095)
    ([0.2, 0.0, 1.0, 0.0], [T, T, F, F], [0.0, 0.0, 1.4702941, -0.6301260]),
    # a fatal trajectory above the group mean keeps its positive advantage
    ([0.2, 0.0, 0.0, 0.0], [T, F, F, F], [1.5, -0.5, -0.5, -0.5]),
    # all-fatal group: statistics over all G, then the negative half is clamped
    ([0.1, 0.0], [T, T], [0.7071033, 0.0]),
]


@pytest.mark.parametrize("rewards, fatal, expected", CLAMP_CASES)
def test_one_sided_clamp(rewards, fatal, expected):
    adv = group_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))
    clamped, weight = apply_mode(adv, torch.tensor(fatal), "fatal_mask_clamp")
    assert clamped.tolist() == pytest.approx(expected, abs=1e-4)  # delta = 1e-6 in the std
    assert weight.tolist() == [1.0] * len(rewards)
    unclamped, _ = apply_mode(adv, torch.tensor(fatal), "fatal_mask")
    assert unclamped.tolist() == pytest.approx(adv.tolist())


def test_hard_mask_drops_fatal_after_group_stats():
    adv = group_advantages(torch.tensor([0.2, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
    out, weight = apply_mode(adv, torch.tensor([T, F, F, F]), "hard_mask")
    assert weight.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert out.tolist() == pytest.approx(adv.tolist())  # others keep stats computed with the fatal one


@pytest.mark.parametrize("log_ratio, adv, expected_loss", [
    (0.0, 2.0, -2.0),
    (math.log(1.5), 1.0, -1.28),   # clipped above at 1 + eps_high
    (math.log(1.5), -1.0, 1.5),    # pessimistic side: unclipped
    (math.log(0.5), 1.0, -0.5),
    (math.log(0.5), -1.0, 0.8),    # clipped below at 1 - eps_low
])
def test_clipped_surrogate(log_ratio, adv, expected_loss):
    logp = torch.tensor([[log_ratio, 0.0]])
    out = policy_loss(logp, torch.zeros(1, 2), torch.tensor([adv]), torch.tensor([[1.0, 0.0]]))
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-6)


@pytest.mark.parametrize("aggregation, expected", [
    ("seq_mean_token_mean", -3.5), ("token_mean", -3.0), ("seq_mean_token_sum", -4.5)])
def test_aggregations(aggregation, expected):
    zeros = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = policy_loss(zeros, zeros, torch.tensor([2.0, 5.0]), mask, aggregation=aggregation)
    assert out.loss.item() == pytest.approx(expected)


def test_fully_masked_trajectory_contributes_zero_and_keeps_divisor():
    zeros = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    out = policy_loss(zeros, zeros, torch.tensor([2.0, 5.0]), mask)
    assert out.loss.item() == pytest.approx(-1.0)  # (2 + 0) / G with G = 2
    assert out.mask_coverage.item() == pytest.approx(1.0)


def test_kl_k3_values_and_in_loss():
    assert kl_k3(torch.tensor(0.3), torch.tensor(0.3)).item() == 0.0
    assert kl_k3(torch.tensor(0.0), torch.tensor(math.log(2))).item() == pytest.approx(1 - math.log(2))
    zeros = torch.zeros(1, 1)
    out = policy_loss(zeros, zeros, torch.tensor([0.0]), torch.ones(1, 1), ref_logp=torch.full((1, 1), math.log(2)),
                      beta=0.5)
    assert out.kl.item() == pytest.approx(1 - math.log(2))
    assert out.loss.item() == pytest.approx(0.5 * (1 - math.log(2)))


def _mode_grads(mode: str, adv_fatal: float) -> torch.Tensor:
    """Gradient of the loss w.r.t. per-token log-probs for a 2-trajectory batch whose first is fatal.

    Trajectory 0: turns 0,1,2 with a cascade starting at turn 1 (mask start 1).
    """
    gen = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    step = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2]])
    fatal = torch.tensor([True, False])
    m = MODES[mode]
    mask = token_mask(gen, step, torch.tensor([1, NOT_FATAL])) if m.mask_post_fatal else gen
    adv, weight = apply_mode(torch.tensor([adv_fatal, 1.0]), fatal, mode)
    logp = torch.zeros(2, 6, requires_grad=True)
    policy_loss(logp, torch.zeros(2, 6), adv, mask, weight, gen_mask=gen).loss.backward()
    return logp.grad


def test_per_mode_gradients_follow_the_table():
    post_fatal = slice(2, 6)
    g = _mode_grads("vanilla", -0.5)
    assert (g[0, post_fatal] != 0).all()                     # vanilla trains post-fatal tokens
    g = _mode_grads("fatal_mask", -0.5)
    assert (g[0, post_fatal] == 0).all() and (g[0, :2] != 0).all()
    g = _mode_grads("hard_mask", -0.5)
    assert (g[0] == 0).all() and (g[1] != 0).all()            # fatal trajectory gets nothing
    g = _mode_grads("fatal_mask_clamp", -0.5)
    assert (g[0] == 0).all()                                   # negative advantage clamped to 0
    g = _mode_grads("fatal_mask_clamp", 0.5)
    assert (g[0, :2] != 0).all() and (g[0, post_fatal] == 0).all()  # positive kept, prefix only
