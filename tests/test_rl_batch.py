"""From scored ``Trajectory`` records to the learner's token mask: ``rl_batch``, ``micro_batches``, ``rank_share``.

Fast (no model): the processor is the tiny checkpoint's (built once per machine, then cached), and
the records are text-only. Fatal records whose cascade start and K-th failure differ go through
the production path (``rl_batch`` -> ``grpo_loss``) under both ``mask_at`` settings; the expected
masks are read off the records' own per-token lists in plain Python.
"""

from __future__ import annotations

import pytest
import torch

from osvl.agent.trajectory import Trajectory
from osvl.errors import DataError
from osvl.rl.learner import RLConfig, grpo_loss
from osvl.rl.learner_loop import micro_batches, rank_share, rl_batch

PROMPT, TOOL = 4, 3  # tokens of the prompt and of each tool answer


def record(gid: int, i: int, turns: int, reward: float = 0.0, fatal: tuple[int, int] = (-1, -1),
           turn_len: int = 2) -> Trajectory:
    """A text-only policy record: a prompt, then ``turns`` generated turns of ``turn_len`` tokens, each followed
    by a tool answer. ``fatal`` is (cascade start, K-th failure), -1s when not fatal."""
    ids, gen, step = [], [], []
    for t in range(-1, turns):
        n = PROMPT if t < 0 else turn_len
        ids += [10 + (7 * len(ids) + k) % 800 for k in range(n)]
        gen += [0 if t < 0 else 1] * n
        step += [t] * n if t >= 0 else [-1] * n
        if t >= 0:
            ids += [20 + k for k in range(TOOL)]
            gen += [0] * TOOL
            step += [-1] * TOOL
    return Trajectory(id=f"g{gid}-{i}", question_id=f"q{gid}", group_id=f"g{gid}", kind="policy", question="",
                      answer="", answer_aliases=[], input_ids=ids, gen_mask=gen, logprobs=[-0.5] * len(ids),
                      step_ids=step, images=[], image_max_pixels=[], processor={}, turns=[],
                      fatal_cascade_start=fatal[0], fatal_kth=fatal[1], reward=reward)


@pytest.fixture(scope="module")
def processor():
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint

    return load_processor(tiny_checkpoint("qwen3_vl"))


def groups() -> list[list[Trajectory]]:
    """Two groups. Fatal rows: cascade 1 / K-th 3, cascade 0 / K-th 0 (K = 1), cascade 2 / K-th 4.
    Row g0-2 (7 turns: 4 + 7 * 5 = 39 tokens) is longer than max_len 36."""
    return [[record(0, 0, 5, 0.1, (1, 3)), record(0, 1, 2, 0.9), record(0, 2, 7, 0.5)],
            [record(1, 0, 2, 0.2, (0, 0)), record(1, 1, 5, 0.7, (2, 4)), record(1, 2, 3, 0.0)]]


def expected_mask(tr: Trajectory, at: str, width: int) -> list[float]:
    """The generated tokens of the turns before the mask start (all of them when the record is not fatal),
    padded with zeros to the batch width."""
    if tr.fatal_kth < 0:
        start = len(tr.input_ids)  # above any turn index
    else:
        start = tr.fatal_cascade_start if at == "cascade" else tr.fatal_kth
    row = [float(g and s < start) for g, s in zip(tr.gen_mask, tr.step_ids, strict=True)]
    return row + [0.0] * (width - len(row))


@pytest.mark.parametrize("at", ["cascade", "kth"])
def test_rl_batch_fatal_records_to_the_training_mask(processor, at):
    gs = groups()
    kept = [gs[0][0], gs[0][1], *gs[1]]  # g0-2 is over max_len and dropped
    cfg = RLConfig(mask_at=at, mode="fatal_mask_clamp", max_len=36, truncation="drop")
    batch = rl_batch(gs, "", processor, cfg)
    assert batch["fatal"].tolist() == [True, False, True, True, False]
    assert batch["group"].tolist() == [0, 0, 1, 1, 1]
    assert batch["reward"].tolist() == pytest.approx([0.1, 0.9, 0.2, 0.7, 0.0])
    assert batch["old_logprobs"][0, :len(kept[0].input_ids)].tolist() == [-0.5] * len(kept[0].input_ids)
    starts = {"cascade": [1, 0, 2], "kth": [3, 0, 4]}[at]
    got = batch["mask_start"].tolist()
    assert [got[0], got[2], got[3]] == starts
    assert got[1] > 100 and got[4] > 100  # non-fatal rows: beyond any turn
    width = batch["gen_mask"].shape[1]
    assert width == max(len(tr.input_ids) for tr in kept)
    sl = grpo_loss(torch.zeros_like(batch["old_logprobs"]), batch, cfg)
    want = [expected_mask(tr, at, width) for tr in kept]
    assert sl.mask.tolist() == want
    generated = sum(sum(tr.gen_mask) for tr in kept)
    assert sl.out.mask_coverage.item() == pytest.approx(sum(map(sum, want)) / generated)
    assert sl.n_fatal == 3
    # the modes that do not mask post-fatal tokens train every generated token of the same batch
    vanilla = grpo_loss(torch.zeros_like(batch["old_logprobs"]), batch, RLConfig(mask_at=at, mode="vanilla"))
    assert vanilla.mask.tolist() == [expected_mask(tr, at, width) if tr.fatal_kth < 0 else
                                     tr.gen_mask + [0] * (width - len(tr.gen_mask)) for tr in kept]


def test_rl_batch_cut_keeps_a_long_row_and_its_group_statistics(processor):
    gs = groups()
    cfg = RLConfig(max_len=36, truncation="cut")
    batch = rl_batch(gs, "", processor, cfg)
    assert batch["group"].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch["truncated"].tolist() == [0, 0, 1, 0, 0, 0]
    assert batch["gen_mask"].shape[1] == 36
    # dropping g0-2 changes group 0's statistics: the rows trained are the rows normalised over
    dropped = rl_batch(gs, "", processor, RLConfig(max_len=36, truncation="drop"))
    assert batch["reward"][:3].tolist() == pytest.approx([0.1, 0.9, 0.5])
    assert dropped["reward"][:2].tolist() == pytest.approx([0.1, 0.9])
    assert len(dropped["reward"]) == 5 and int(dropped["n_dropped"]) == 0  # left out before collate
    with pytest.raises(DataError, match="truncation must be one of"):  # a misspelt policy is refused, not guessed
        rl_batch(gs, "", processor, RLConfig(max_len=36, truncation="cutt"))


def test_rl_batch_null_control_hands_each_reward_to_the_next_sample(processor):
    """The null control's advantages are the real ones moved one sample on within each group (same sizes, no
    information about which sample did better); the rewards recorded stay each sample's own."""
    gs = groups()
    real = rl_batch(gs, "", processor, RLConfig(max_len=100))
    null = rl_batch(gs, "", processor, RLConfig(max_len=100, null_control=True))
    assert null["reward"].tolist() == real["reward"].tolist()
    for g in (slice(0, 3), slice(3, 6)):
        assert null["raw_adv"][g].tolist() == pytest.approx(real["raw_adv"][g].roll(1).tolist())
    first, last = real["raw_adv"][0].item(), real["raw_adv"][2].item()
    assert null["raw_adv"][0].item() == pytest.approx(last) and last != pytest.approx(first)


def _ids(chunks) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [[(g[0].group_id, rows) for g, rows in chunk] for chunk in chunks]


def test_micro_batches_fill_a_token_budget_shortest_group_first():
    def group(gid: int, n: int, turn_len: int) -> list[Trajectory]:
        return [record(gid, i, 2, turn_len=turn_len) for i in range(n)]

    # row lengths 4 + 2 * (turn_len + 3): g0 28, g1 16, g2 20, g3 90 (over max_len 70), g4 18, g5 14
    gs = [group(0, 4, 9), group(1, 2, 3), group(2, 4, 5), group(3, 4, 40), group(4, 6, 4), group(5, 2, 2)]
    cfg = RLConfig(max_len=70, truncation="drop", micro_tokens=64)
    # groups by their longest row, rows shortest first, a new micro-batch when the next row would pass 64 tokens:
    # g4 (108 tokens) and g0 (112) are split, g3 is left out
    assert _ids(micro_batches(gs, cfg)) == [
        [("g5", (0, 1)), ("g1", (0, 1))], [("g4", (0, 1, 2))], [("g4", (3, 4, 5))], [("g2", (0, 1, 2))],
        [("g2", (3,)), ("g0", (0,))], [("g0", (1, 2))], [("g0", (3,))]]
    one = micro_batches(gs, RLConfig(max_len=70, truncation="drop", micro_tokens=0))
    assert _ids(one) == [[("g5", (0, 1)), ("g1", (0, 1)), ("g4", tuple(range(6))), ("g2", (0, 1, 2, 3)),
                          ("g0", (0, 1, 2, 3))]]
    exact = micro_batches(gs, RLConfig(max_len=70, truncation="drop", micro_tokens=60))  # 28 + 32: exactly full
    assert _ids(exact)[0] == [("g5", (0, 1)), ("g1", (0, 1))] and _ids(exact)[1] == [("g4", (0, 1, 2))]
    # a group with a row over max_len is sorted by its longest *trainable* row, and counts only those
    mixed = [group(0, 2, 9), [record(1, 0, 2, turn_len=40), record(1, 1, 2, turn_len=1)]]
    packed = micro_batches(mixed, RLConfig(max_len=70, truncation="drop", micro_tokens=68))  # 12 + 56
    assert _ids(packed) == [[("g1", (1,)), ("g0", (0, 1))]]
    # a row larger than the budget is a micro-batch alone
    assert _ids(micro_batches([group(6, 2, 2), group(0, 1, 9)], RLConfig(max_len=70, micro_tokens=20))) == [
        [("g6", (0,))], [("g6", (1,))], [("g0", (0,))]]
    # a record of exactly max_len tokens (4 + 2 * 33) is trainable
    assert _ids(micro_batches([[record(9, 0, 2, turn_len=30)]], cfg)) == [[("g9", (0,))]]
    # under "cut" nothing is left out for length, and a cut row counts max_len tokens: g3's rows are 4 x 70
    cut = micro_batches(gs, RLConfig(max_len=70, truncation="cut", micro_tokens=0))
    assert [g for g, _ in cut[0]] == [gs[5], gs[1], gs[4], gs[2], gs[0], gs[3]]
    assert _ids(micro_batches([gs[3], gs[5]], RLConfig(max_len=70, truncation="cut", micro_tokens=308))) == [
        [("g5", (0, 1)), ("g3", (0, 1, 2, 3))]]
    assert len(micro_batches([gs[3], gs[5]], RLConfig(max_len=70, truncation="cut", micro_tokens=307))) == 2


def test_a_group_split_over_micro_batches_keeps_its_whole_group_statistics(processor):
    """A micro-batch holding part of a group normalises its rows' rewards over the whole group, so the pieces'
    losses over the step's divisor add up to the loss of the group in one batch."""
    from osvl.rl.learner import batch_divisor

    g = [record(0, i, 2, reward=r, fatal=(0, 1) if i == 3 else (-1, -1)) for i, r in enumerate([0.1, 0.9, 0.4, 0.0])]
    cfg = RLConfig(max_len=70, truncation="drop", mode="fatal_mask_clamp")
    whole = rl_batch([g], "", processor, cfg)
    parts = [rl_batch([(g, rows)], "", processor, cfg) for rows in ((0, 2), (1, 3))]
    assert torch.allclose(torch.cat([p["raw_adv"] for p in parts]), whole["raw_adv"][[0, 2, 1, 3]])
    assert float(whole["raw_adv"].std()) > 0.5  # normalised: the pieces alone would give other values
    logp = {id(b): -0.5 * b["gen_mask"] + 0.1 * torch.arange(b["gen_mask"].shape[1]) * b["gen_mask"] / 30
            for b in (whole, *parts)}
    div = sum(batch_divisor(b, cfg) for b in parts)
    assert float(div) == pytest.approx(float(batch_divisor(whole, cfg)))
    got = sum(grpo_loss(logp[id(b)], b, cfg, divisor=div).out.loss for b in parts)
    assert float(got) == pytest.approx(float(grpo_loss(logp[id(whole)], whole, cfg).out.loss), rel=1e-6)


def test_rank_share_whole_groups_and_stand_ins():
    def group(gid: int, n: int, turn_len: int) -> list[Trajectory]:
        return [record(gid, i, 2, turn_len=turn_len) for i in range(n)]

    gs = [group(0, 4, 9), group(1, 2, 3), group(2, 4, 5)]  # rows of 28, 16 and 20 tokens
    cfg = RLConfig(max_len=70, truncation="drop", micro_tokens=64)
    zero, one = rank_share(gs, 0, 2, cfg), rank_share(gs, 1, 2, cfg)
    # rank 0 takes groups 0 and 2 (four micro-batches), rank 1 group 1 and three stand-ins
    assert [(_ids([chunk])[0], live) for chunk, live in zero] == [
        ([("g2", (0, 1, 2))], True), ([("g2", (3,)), ("g0", (0,))], True), ([("g0", (1, 2))], True),
        ([("g0", (3,))], True)]
    assert (_ids([one[0][0]])[0], one[0][1]) == ([("g1", (0, 1))], True)
    assert len(one) == 4 and all(chunk == [([gs[1][0]], (0,))] and not live for chunk, live in one[1:])
    # the stand-in is the step's shortest trainable record (the first of them)
    assert _ids(c for c, _ in rank_share(gs, 0, 1, cfg)) == [
        [("g1", (0, 1)), ("g2", (0,))], [("g2", (1, 2, 3))], [("g0", (0, 1))], [("g0", (2, 3))]]
    # fewer groups than ranks: the idle rank trains only stand-ins, one per micro-batch of the other (56 + 56)
    assert rank_share(gs[:1], 1, 2, cfg) == [([([gs[0][0]], (0,))], False)] * 2
    # nothing trainable in the whole step: every rank skips it
    assert rank_share([group(3, 2, 40)], 0, 2, cfg) is None
    assert rank_share([], 0, 2, cfg) is None


def test_rl_batch_reads_the_pixels_from_the_image_folder(processor, tmp_path):
    """An image record's pixels come from ``image_dir`` (what the engine saw, rebuilt by ``processor_inputs``)."""
    import numpy as np

    from osvl import chat as fmt
    from osvl.agent.trajectory import TrajectoryBuilder, Turn, png_bytes, processor_inputs

    img = (np.arange(56 * 84 * 3) % 251).astype(np.uint8).reshape(56, 84, 3)
    bld = TrajectoryBuilder(processor)
    bld.add_image(img)
    bld.add_text(fmt.render([{"role": "user", "content": "Q?", "images": ["img_1"]}], add_generation_prompt=True))
    bld.add_model_text(fmt.assistant_text("done", response="A"), 0)
    bld.add_text(f"{fmt.IM_END}\n")
    tr = bld.build(kind="teacher", id="i0", question_id="q", group_id="g", question="Q?", answer="A",
                   answer_aliases=[], turns=[Turn(0, "done", "response")], stop_reason="response", budgets={})
    (sha,) = tr.images
    (tmp_path / f"{sha}.png").write_bytes(png_bytes(img))
    batch = rl_batch([[tr]], str(tmp_path), processor, RLConfig(max_len=10_000))
    want = processor_inputs([img], tr.image_max_pixels, processor)
    assert torch.equal(batch["pixel_values"], torch.as_tensor(want["pixel_values"]))
    assert batch["fatal"].tolist() == [False] and batch["old_logprobs"].abs().sum() == 0  # a teacher record
