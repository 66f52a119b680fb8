"""Trajectory records: the builder expands images like the processor, Parquet round-trips, images stored once."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from osvl import chat as fmt
from osvl.agent.trajectory import (
    TrajectoryBuilder,
    Turn,
    image_hash,
    load_image,
    processor_inputs,
    read_trajectories,
    write_trajectories,
)
from osvl.errors import DataError
from osvl.models.load import load_processor
from osvl.models.tiny import tiny_checkpoint

TOOLS = [{"type": "function", "function": {"name": "crop", "description": "Crop.",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def processor():
    return load_processor(tiny_checkpoint("qwen3_vl"))


def pictures() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (300, 500, 3), dtype=np.uint8), rng.integers(0, 256, (90, 60, 3), dtype=np.uint8)]


def record(processor, traj_id: str = "t0", max_pixels: int | None = None):
    """A two-image teacher record built the way the loop builds one."""
    a, b = pictures()
    bld = TrajectoryBuilder(processor)
    bld.add_image(a)
    bld.add_text(fmt.render([{"role": "user", "content": "Q?", "images": ["img_1"]}], tools=TOOLS,
                            add_generation_prompt=True))
    bld.add_model_text(fmt.assistant_text("look", tool_call={"name": "crop", "arguments": {"image": "img_1"}}), 0)
    bld.add_image(b, max_pixels)
    bld.add_text(f"{fmt.IM_END}\n{fmt.IM_START}user\n{fmt.TOOL_RESPONSE_OPEN}\nok\n{fmt.TOOL_RESPONSE_CLOSE}\n"
                 f"{fmt.IMAGE_TOKENS}img_2{fmt.IM_END}\n{fmt.IM_START}assistant\n")
    bld.add_model_text(fmt.assistant_text("done", response="A"), 1)
    bld.add_text(f"{fmt.IM_END}\n")
    turns = [Turn(0, "look", "tool_call", "crop", {"image": "img_1"}, "ok", new_images=["img_2"]),
             Turn(1, "done", "response")]
    t = bld.build(kind="teacher", id=traj_id, question_id="q", group_id="g", question="Q?", answer="A",
                  answer_aliases=["a"], turns=turns, stop_reason="response", budgets={"max_turns": 8})
    return t, bld


def test_builder_expands_images_exactly_like_the_processor(processor):
    t, bld = record(processor)
    a, b = pictures()
    text = fmt.render([{"role": "user", "content": "Q?", "images": ["img_1"]},
                       {"role": "assistant", "content": fmt.assistant_text(
                           "look", tool_call={"name": "crop", "arguments": {"image": "img_1"}})},
                       {"role": "tool", "content": "ok", "images": ["img_2"]},
                       {"role": "assistant", "content": fmt.assistant_text("done", response="A")}], tools=TOOLS)
    want = processor(images=[a, b], text=[text], return_tensors="pt")
    assert t.input_ids == want["input_ids"][0].tolist()
    got = processor_inputs([a, b], t.image_max_pixels, processor)
    assert torch.equal(got["pixel_values"], want["pixel_values"].float())
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    # gen_mask covers exactly the two assistant texts, step ids name their turns
    tok = processor.tokenizer
    gen = [i for i, g in zip(t.input_ids, t.gen_mask, strict=True) if g]
    assert tok.decode(gen) == fmt.assistant_text("look", tool_call={"name": "crop", "arguments": {"image": "img_1"}}) \
        + fmt.assistant_text("done", response="A")
    assert {s for s, g in zip(t.step_ids, t.gen_mask, strict=True) if g} == {0, 1}
    assert all(s == -1 for s, g in zip(t.step_ids, t.gen_mask, strict=True) if not g)
    assert t.logprobs == [] and t.kind == "teacher"


def test_lower_max_pixels_gives_fewer_pads_and_matching_pixels(processor):
    t, bld = record(processor, max_pixels=4096)
    assert t.image_max_pixels[1] == 4096
    pads = processor.tokenizer.convert_tokens_to_ids(fmt.IMAGE_PAD)
    grid = processor_inputs(bld.images, t.image_max_pixels, processor)["image_grid_thw"]
    assert t.input_ids.count(pads) == int(grid.prod(dim=1).sum()) // 4


def test_parquet_round_trip_and_images_once(processor, tmp_path):
    t1, bld = record(processor, "t1")
    t2, _ = record(processor, "t2")
    store = bld.image_map()
    part = write_trajectories(tmp_path, [t1], store)
    write_trajectories(tmp_path, [t2], store)
    assert part.parent == tmp_path / "trajectories.parquet"
    assert len(list((tmp_path / "images").glob("*.png"))) == 2  # shared by both records, stored once
    assert pq.read_table(tmp_path / "trajectories.parquet").num_rows == 2
    back = read_trajectories(tmp_path)
    assert back == [t1, t2]
    for sha, arr in zip(t1.images, bld.images, strict=True):
        assert sha == image_hash(arr)
        assert np.array_equal(load_image(tmp_path / "images", sha), arr)


def test_policy_logprobs_round_trip_in_float32(processor, tmp_path):
    bld = TrajectoryBuilder(processor)
    bld.add_text(f"{fmt.IM_START}user\nQ{fmt.IM_END}\n{fmt.IM_START}assistant\n")
    ids = processor.tokenizer("<think>x</think>", add_special_tokens=False)["input_ids"]
    lps = [-0.123456789 * (i + 1) for i in range(len(ids))]
    bld.add_generated(ids, lps, 0)
    t = bld.build(kind="policy", id="p", question_id="q", group_id="", question="Q", answer="", answer_aliases=[],
                  turns=[Turn(0, "x", "invalid", policy_version=3)])
    write_trajectories(tmp_path, [t], {})
    (back,) = read_trajectories(tmp_path)
    assert back.turns[0].policy_version == 3
    assert back.gen_mask == t.gen_mask and back.input_ids == t.input_ids
    assert max(abs(x - y) for x, y in zip(back.logprobs, t.logprobs, strict=True)) < 1e-6


def test_bad_records_are_refused(processor, tmp_path):
    t, _ = record(processor)
    with pytest.raises(DataError):  # an image the writer was not given
        write_trajectories(tmp_path, [t], {})
    t.gen_mask = t.gen_mask[:-1]
    with pytest.raises(DataError):
        t.check()
    bld = TrajectoryBuilder(processor)
    with pytest.raises(DataError):  # a pad with no registered image
        bld.add_text(fmt.IMAGE_TOKENS)
