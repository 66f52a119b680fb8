"""Fatal-aware GRPO math against hand-computed values (docs/design.md, per-mode table)."""

from __future__ import annotations

import math

import pytest
import torch

from osvl.agent.fatal import NOT_FATAL, Fatal, find_fatal, mask_start
from osvl.errors import ConfigError
from osvl.rl.loss import (
    MODES,
    apply_mode,
    group_advantages,
    kl_k3,
    loss_divisor,
    policy_loss,
    stats_members,
    token_mask,
)

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


def test_hard_mask_in_stats_drops_fatal_after_group_stats():
    adv = group_advantages(torch.tensor([0.2, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
    out, weight = apply_mode(adv, torch.tensor([T, F, F, F]), "hard_mask_in_stats")
    assert weight.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert out.tolist() == pytest.approx(adv.tolist())  # others keep stats computed with the fatal one


def test_hard_mask_drops_fatal_from_group_stats():
    """The paper's hard mask: rewards [0.9(fatal), 0, 1, 0.5] -> statistics over [0, 1, 0.5] only: mean 0.5, unbiased
    std 0.5, so the non-fatal advantages are -1, 1, 0 (with the fatal row kept they would be -1.32, 0.88, -0.22)."""
    rewards, fatal = torch.tensor([0.9, 0.0, 1.0, 0.5]), torch.tensor([T, F, F, F])
    group = torch.zeros(4, dtype=torch.long)
    raw = group_advantages(rewards, group, member=stats_members(fatal, "hard_mask"))
    adv, weight = apply_mode(raw, fatal, "hard_mask")
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0], abs=1e-5)
    assert weight.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert stats_members(fatal, "hard_mask_in_stats") is None
    kept = group_advantages(rewards, group)
    assert kept[1:].tolist() == pytest.approx([-1.3198, 0.8799, -0.2200], abs=1e-3)
    # a group left with one non-fatal member compares nothing: every advantage 0
    lone = group_advantages(rewards, group, member=torch.tensor([F, F, T, F]))
    assert lone.tolist() == [0.0] * 4


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
    for hard in ("hard_mask", "hard_mask_in_stats"):
        g = _mode_grads(hard, -0.5)
        assert (g[0] == 0).all() and (g[1] != 0).all()        # fatal trajectory gets nothing
    g = _mode_grads("fatal_mask_clamp", -0.5)
    assert (g[0] == 0).all()                                   # negative advantage clamped to 0
    g = _mode_grads("fatal_mask_clamp", 0.5)
    assert (g[0, :2] != 0).all() and (g[0, post_fatal] == 0).all()  # positive kept, prefix only


# ---------------------------------------------------------------------------
# Loss magnitudes in every mode and aggregation, with a dropped and a clamped row (weights not all ones).
# The expected values are plain-Python arithmetic of docs/design.md's formula, not calls of the code under test.

# docs/design.md's per-mode table: (mask post-fatal tokens, drop fatal rows, clamp fatal negatives to 0, fatal rows in
# the group statistics)
MODE_TABLE = {"vanilla": (F, F, F, T), "hard_mask": (F, T, F, F), "hard_mask_in_stats": (F, T, F, T),
              "fatal_mask": (T, F, F, T), "fatal_mask_clamp": (T, F, T, T)}
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum")
FULL = ([0, 1, 1, 0, 1, 1, 0, 1], [-1, 0, 0, -1, 1, 1, -1, 2])  # prompt, turn 0, tool, turn 1, tool, turn 2
TWO = ([0, 1, 1, 0, 1, 1, 0, 0], [-1, 0, 0, -1, 1, 1, -1, -1])   # two turns, then padding
ONE = ([0, 1, 1, 0, 0, 0, 0, 0], [-1, 0, 0, -1, -1, -1, -1, -1])
# two groups of 3; row 0 is fatal below its group's mean (clamped / dropped), row 3 fatal above it (kept)
ROWS = [
    dict(group=0, reward=0.1, fatal=T, start=1, layout=FULL),
    dict(group=0, reward=0.9, fatal=F, start=NOT_FATAL, layout=FULL),
    dict(group=0, reward=0.7, fatal=F, start=NOT_FATAL, layout=TWO),
    dict(group=1, reward=0.6, fatal=T, start=2, layout=FULL),
    dict(group=1, reward=0.0, fatal=F, start=NOT_FATAL, layout=ONE),
    dict(group=1, reward=0.2, fatal=F, start=NOT_FATAL, layout=FULL),
]
LOG_RATIOS = [0.0, 0.1, -0.1, math.log(1.5), math.log(0.5)]  # two of them outside [1 - 0.2, 1 + 0.28]


def _log_ratio(i: int, t: int) -> float:
    return LOG_RATIOS[(3 * i + t) % len(LOG_RATIOS)]


def _ref_logp(i: int, t: int) -> float:
    return 0.05 * ((i + t) % 4)


def _old_logp(i: int, t: int) -> float:
    """Behaviour log-probs (not 0: the ratio is exp(logp - old_logp), whatever their level)."""
    return -0.5 - 0.1 * ((i + 2 * t) % 5)


def _loss_batch(rows=ROWS) -> dict[str, torch.Tensor]:
    ix = [ROWS.index(r) for r in rows]
    return {
        "gen_mask": torch.tensor([r["layout"][0] for r in rows], dtype=torch.float32),
        "step_ids": torch.tensor([r["layout"][1] for r in rows]),
        "old_logprobs": torch.tensor([[_old_logp(i, t) for t in range(8)] for i in ix]),
        "reward": torch.tensor([r["reward"] for r in rows]),
        "group": torch.tensor([r["group"] for r in rows]),
        "fatal": torch.tensor([r["fatal"] for r in rows]),
        "mask_start": torch.tensor([r["start"] for r in rows]),
        "logp": torch.tensor([[_old_logp(i, t) + _log_ratio(i, t) for t in range(8)] for i in ix]),
        "ref_logp": torch.tensor([[_ref_logp(i, t) for t in range(8)] for i in ix]),
    }


def _expected_loss(mode: str, aggregation: str, beta: float) -> dict[str, float]:
    """docs/design.md's J for ROWS, in plain Python: group statistics over all G (unbiased std, δ = 1e-6),
    then the mode's clamp / drop, then the token mask; ε_low 0.2, ε_high 0.28; divisor B for the sequence
    aggregations, Σ_i w_i Σ_t M_it for token_mean."""
    mask_post, drop, clamp, in_stats = MODE_TABLE[mode]
    B = len(ROWS)
    pg_sums, kl_sums, n_masked, weights, advs = [], [], [], [], []
    clipped = masked = generated = 0
    for i, row in enumerate(ROWS):
        peers = [r["reward"] for r in ROWS if r["group"] == row["group"] and (in_stats or not r["fatal"])]
        mean = sum(peers) / len(peers)
        std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
        a = (row["reward"] - mean) / (std + 1e-6) if in_stats or not row["fatal"] else 0.0
        if clamp and row["fatal"]:
            a = max(a, 0.0)
        advs.append(a)
        weights.append(0.0 if drop and row["fatal"] else 1.0)
        gen, step = row["layout"]
        pg = kl = 0.0
        n = 0
        for t in range(8):
            if not gen[t]:
                continue
            generated += 1
            if mask_post and step[t] >= row["start"]:
                continue
            rho = math.exp(_log_ratio(i, t))
            pg += min(rho * a, min(max(rho, 0.8), 1.28) * a)
            r = _ref_logp(i, t) - (_old_logp(i, t) + _log_ratio(i, t))
            kl += math.exp(r) - r - 1
            n += 1
            clipped += not 0.8 <= rho <= 1.28
        masked += n
        pg_sums.append(pg)
        kl_sums.append(kl)
        n_masked.append(n)

    def aggregate(sums: list[float]) -> float:
        rows = list(zip(weights, sums, n_masked, strict=True))
        if aggregation == "token_mean":
            return sum(w * s for w, s, _ in rows) / sum(w * n for w, _, n in rows)
        if aggregation == "seq_mean_token_mean":
            return sum(w * s / max(n, 1) for w, s, n in rows) / B
        return sum(w * s for w, s, _ in rows) / B

    pg, kl = -aggregate(pg_sums), aggregate(kl_sums)
    return {"loss": pg + beta * kl, "policy_loss": pg, "kl": kl, "clip_fraction": clipped / masked,
            "mask_coverage": masked / generated, "adv": advs}


def test_expected_loss_rows_are_dropped_and_clamped():
    """The fixture does what the loss tests rely on: a fatal row below its group's mean (row 0) and one
    above it (row 3), and rows whose masks differ in size."""
    clamp = _expected_loss("fatal_mask_clamp", "token_mean", 0.0)["adv"]
    plain = _expected_loss("fatal_mask", "token_mean", 0.0)["adv"]
    assert plain[0] < 0 and clamp[0] == 0.0 and plain[3] > 0 and clamp[3] == plain[3]
    assert set(MODE_TABLE) == set(MODES)
    assert _expected_loss("hard_mask", "token_mean", 0)["loss"] != _expected_loss("vanilla", "token_mean", 0)["loss"]
    assert _expected_loss("hard_mask", "token_mean", 0)["adv"][1] != _expected_loss("hard_mask_in_stats", "token_mean",
                                                                                      0)["adv"][1]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", list(MODE_TABLE))
def test_grpo_loss_magnitude_every_mode_and_aggregation(mode, aggregation):
    from osvl.rl.learner import RLConfig, grpo_loss

    batch = _loss_batch()
    cfg = RLConfig(mode=mode, aggregation=aggregation, beta=0.1)
    sl = grpo_loss(batch["logp"], batch, cfg, batch["ref_logp"])
    want = _expected_loss(mode, aggregation, 0.1)
    assert sl.out.loss.item() == pytest.approx(want["loss"], abs=1e-5)
    assert sl.out.policy_loss.item() == pytest.approx(want["policy_loss"], abs=1e-5)
    assert sl.out.kl.item() == pytest.approx(want["kl"], abs=1e-6)
    assert sl.out.clip_fraction.item() == pytest.approx(want["clip_fraction"])
    assert sl.out.mask_coverage.item() == pytest.approx(want["mask_coverage"])
    assert sl.adv.tolist() == pytest.approx(want["adv"], abs=1e-5)
    # counted in every mode; the paper's hard mask gives fatal rows no normalised reward at all
    assert (sl.clamped, sl.kept_positive, sl.n_fatal) == ((1, 1, 2) if MODE_TABLE[mode][3] else (0, 0, 2))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", list(MODE_TABLE))
def test_policy_loss_magnitude_every_mode_and_aggregation(mode, aggregation):
    """The same figures through loss.py's own pieces: group_advantages, apply_mode, token_mask, policy_loss."""
    batch = _loss_batch()
    raw = group_advantages(batch["reward"], batch["group"], member=stats_members(batch["fatal"], mode))
    adv, weight = apply_mode(raw, batch["fatal"], mode)
    start = batch["mask_start"] if MODE_TABLE[mode][0] else torch.full((len(ROWS),), NOT_FATAL)
    mask = token_mask(batch["gen_mask"], batch["step_ids"], start)
    out = policy_loss(batch["logp"], batch["old_logprobs"], adv, mask, weight, ref_logp=batch["ref_logp"], beta=0.1,
                      aggregation=aggregation, gen_mask=batch["gen_mask"])
    want = _expected_loss(mode, aggregation, 0.1)
    assert out.loss.item() == pytest.approx(want["loss"], abs=1e-5)
    assert out.kl.item() == pytest.approx(want["kl"], abs=1e-6)
    assert out.mask_coverage.item() == pytest.approx(want["mask_coverage"])
    assert weight.tolist() == [0.0 if MODE_TABLE[mode][1] and r["fatal"] else 1.0 for r in ROWS]


DROPPED_ROW_LOSS = {
    # rows: adv 2 on 2 tokens (dropped), adv 1 on 2 tokens, adv -3 on 1 token; logp = old_logp (ratio 1)
    "seq_mean_token_mean": -(0 * 2 + 1 * 1 + 1 * -3) / 3,      # divisor B = 3, not the 2 surviving rows
    "token_mean": -(1 + 1 - 3) / 3,                           # divisor: the 3 tokens of weighted rows
    "seq_mean_token_sum": -(0 * 4 + 1 * 2 + 1 * -3) / 3,
}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_with_a_dropped_row_keeps_the_divisor(aggregation):
    expected = DROPPED_ROW_LOSS[aggregation]
    zeros = torch.zeros(3, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    out = policy_loss(zeros, zeros, torch.tensor([2.0, 1.0, -3.0]), mask, torch.tensor([0.0, 1.0, 1.0]),
                      aggregation=aggregation)
    assert out.loss.item() == pytest.approx(expected)


def test_loss_divisor_counts_rows_or_weighted_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    weight = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert loss_divisor(mask, weight, "seq_mean_token_mean").item() == 4.0  # every row, dropped or empty
    assert loss_divisor(mask, weight, "seq_mean_token_sum").item() == 4.0
    assert loss_divisor(mask, weight, "token_mean").item() == 1.0 + 0.0 + 3.0  # row 0's 2 tokens weigh 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", list(MODE_TABLE))
def test_micro_batches_over_the_step_divisor_add_up_to_the_whole_batch(mode, aggregation):
    """Each group alone, over the step's divisor (``batch_divisor`` summed), adds up to the one-batch loss."""
    from osvl.rl.learner import RLConfig, batch_divisor, grpo_loss

    cfg = RLConfig(mode=mode, aggregation=aggregation, beta=0.1)
    parts = [_loss_batch(ROWS[:3]), _loss_batch(ROWS[3:])]
    divisor = sum(batch_divisor(p, cfg) for p in parts)
    total = sum(grpo_loss(p["logp"], p, cfg, p["ref_logp"], divisor=divisor).out.loss.item() for p in parts)
    assert total == pytest.approx(_expected_loss(mode, aggregation, 0.1)["loss"], abs=1e-5)
    stand_in = grpo_loss(parts[0]["logp"], parts[0], cfg, parts[0]["ref_logp"], live=False, divisor=divisor)
    assert stand_in.out.loss.item() == 0.0 and stand_in.n_fatal == 0 and batch_divisor(parts[0], cfg, False) == 0


def test_kl_term_only_with_a_positive_beta():
    batch = _loss_batch()
    out = policy_loss(batch["logp"], batch["old_logprobs"], torch.ones(len(ROWS)), batch["gen_mask"],
                      ref_logp=batch["ref_logp"], beta=0.0)
    assert out.kl.item() == 0.0
    assert out.loss.item() == pytest.approx(out.policy_loss.item())


def test_group_advantages_details():
    # integer rewards (r_acc alone) still give fractional advantages
    adv = group_advantages(torch.tensor([1, 0, 0, 1]), torch.zeros(4, dtype=torch.long))
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-5)
    # a singleton group does not end the pass over the groups after it
    adv = group_advantages(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([0, 1, 1]))
    assert adv.tolist() == pytest.approx([0.0, 0.7071064, -0.7071064], abs=1e-5)
    # δ keeps nearly identical rewards from blowing up: ±5e-7 / (7.07e-7 + 1e-6)
    adv = group_advantages(torch.tensor([0.0, 1e-6]), torch.zeros(2, dtype=torch.long))
    assert adv.tolist() == pytest.approx([-0.2928932, 0.2928932], rel=1e-3)
    with pytest.raises(ValueError, match="baseline must be 'grpo' or 'rloo', got 'ppo'"):
        group_advantages(torch.tensor([1.0]), torch.tensor([0]), baseline="ppo")


def test_policy_loss_reports_and_errors():
    one = torch.ones(1, 1)
    # a single trained token, clipped: clip fraction 1, coverage 1 (divisors clamped at 1 token, not more)
    out = policy_loss(torch.full((1, 1), math.log(1.5)), torch.zeros(1, 1), torch.tensor([1.0]), one, gen_mask=one)
    assert out.clip_fraction.item() == 1.0 and out.mask_coverage.item() == 1.0
    # a ratio exactly at a bound is not clipped (here both bounds are 1)
    out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), eps_low=0.0,
                      eps_high=0.0)
    assert out.clip_fraction.item() == 0.0 and out.loss.item() == -1.0
    # the KL term is off by default, even with reference log-probs
    out = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), one, ref_logp=torch.ones(1, 1))
    assert out.kl.item() == 0.0 and out.loss.item() == -1.0
    with pytest.raises(ValueError, match="aggregation must be one of .*got 'sum'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]), one, aggregation="sum")


def test_fatal_rule_errors_name_the_setting():
    assert find_fatal([F, T, T, T]) == Fatal(1, 3) and find_fatal([T, T, F, T, T]) is None  # K = 3 by default
    with pytest.raises(ConfigError, match="K must be >= 1, got 0"):
        find_fatal([T], 0)
    with pytest.raises(ConfigError, match=r"mask start must be one of \('cascade', 'kth'\), got 'nope'"):
        mask_start(2, 4, "nope")
