"""Held-out evaluation bookkeeping: questions dealt over seed entities, Pass@1 with seed-clustered and paired SEs."""

import dataclasses
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from osvl.rl.report import clustered_mean_se, heldout_report, mean_se, summarize, summary_lines, verdict
from osvl.rl.trainer import heldout_questions


def _row(qid: str, seed: int) -> dict:
    return {"id": qid, "question": "q", "answer": "a", "path": [{"entity_id": seed, "title": f"s{seed}"}]}


def test_heldout_questions_deal_round_robin_over_seeds(tmp_path):
    rows = [_row(f"{seed}{k}", seed) for seed in (7, 3, 9) for k in range(4)]
    pq.write_table(pa.Table.from_pylist(rows[::-1]), tmp_path / "heldout.parquet")
    got = [r["id"] for r in heldout_questions(tmp_path / "heldout.parquet", 5)]
    # seeds in order of their first id (30 < 70 < 90), each seed's questions in id order
    assert got == ["30", "70", "90", "31", "71"]
    assert len(heldout_questions(tmp_path / "heldout.parquet", 100)) == 12


def test_clustered_se_is_the_iid_se_with_one_question_per_seed_and_larger_when_seeds_agree():
    xs = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert clustered_mean_se(xs, [str(i) for i in range(8)]) == pytest.approx(mean_se(xs))
    # the same scores, each seed all right or all wrong: 2 effective samples per 4 seeds' worth of questions
    m, se = clustered_mean_se([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], list("aabbccdd"))
    assert m == 0.5 and se > mean_se(xs)[1]
    # by hand: cluster sums of (x - m) are +1, -1, +1, -1; G/(G-1) * 4 / n^2
    assert se == pytest.approx(math.sqrt(4 / 3 * 4) / 8)
    assert math.isnan(clustered_mean_se([1.0, 0.0], ["a", "a"])[1])  # one seed: no SE to be had


def test_heldout_report_pairs_the_two_models_by_question():
    qs = [_row(str(i), i % 4) for i in range(8)]
    before = {"agentic": [0.0] * 8, "direct": [0.0] * 8}
    after = {"agentic": [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0], "direct": [0.0] * 8}
    h = heldout_report(qs, before, after)
    assert h["heldout"] == 8 and h["heldout_seeds"] == 4
    assert h["pass1_sft"] == 0.0 and h["pass1_grpo"] == 0.75 and h["pass1_diff"] == 0.75
    assert h["better"] == (0.75 > 2 * h["pass1_diff_se"]) and h["direct_grpo"] == 0.0
    steps = [{"reward": 0.1 * k, "fatal_rate": 0.0, "staleness": {"0": 2}} for k in range(3)]
    run = dataclasses.replace(summarize(steps), **h, mode="fatal_mask_clamp")
    buffer = {"staleness": {"0": 6}}
    assert "after GRPO 0.750 ±" in summary_lines(run, buffer, [])[-1]
    none = heldout_report(qs, before, None)
    assert none["pass1_grpo"] is None and none["pass1_diff"] is None and not none["better"]
    half = dataclasses.replace(summarize(steps), **none, mode="vanilla")
    assert "after GRPO n/a" in summary_lines(half, buffer, [])[-1] and "vanilla does not clamp" in \
        summary_lines(half, buffer, [])[2]
    # the job's last line: OK only with every step trained and both sides scored (or no held-out asked)
    assert verdict("demo", run, 3, 8)[0] and verdict("demo", run, 3, 8)[1].startswith("demo: OK")
    assert verdict("demo", run, 4, 8) == (False, f"demo: FAILED — 3 of 4 GRPO steps trained, held-out evaluation "
                                                 f"done; see {run.out}")
    assert not verdict("grpo", half, 3, 8)[0] and "evaluation missing" in verdict("grpo", half, 3, 8)[1]
    assert verdict("grpo", half, 3, 0)[0]
