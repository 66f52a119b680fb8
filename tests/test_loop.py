"""The agent loop with a chat engine (the scripted teacher) and real tools: records, fatal steps, budgets.

Deterministic episodes: ``ScriptedTeacher`` plays fixed turns through the real loop, and the
tools are real ``Tool`` objects in a ``ToolClient`` over ``InProcessTransport`` (crop from the
registry, plus ``probe``, a tool that fails when asked to, for the fatal-step rules).
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from osvl import chat as fmt
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.scripted import ScriptedTeacher
from osvl.agent.trajectory import processor_inputs
from osvl.errors import ConfigError
from osvl.models.load import load_processor
from osvl.models.tiny import tiny_checkpoint
from osvl.tools.base import Tool, ToolResult
from osvl.tools.client import InProcessTransport, ToolClient
from osvl.tools.outages import OutageConfig, draw_outage, with_outages
from osvl.tools.registry import all_tools

QUESTION = "Which tower is this?"


def probe(ctx, fail: bool = False) -> ToolResult:
    if fail:
        raise RuntimeError("the probe was told to fail")
    return ToolResult("ok", "probe ok")


PROBE = Tool("probe", "Succeeds or fails on request.",
             {"type": "object", "properties": {"fail": {"type": "boolean"}}, "required": []}, probe)
TOOLS = {"probe": PROBE, "crop": all_tools()["crop"]}
SCHEMAS = [t.schema for t in TOOLS.values()]


@pytest.fixture(scope="module")
def processor():
    return load_processor(tiny_checkpoint("qwen3_vl"))


def picture() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, (300, 500, 3), dtype=np.uint8)


def call(name: str, **arguments) -> str:
    return fmt.assistant_text(f"call {name}", tool_call={"name": name, "arguments": arguments})


FAIL, OK = call("probe", fail=True), call("probe", fail=False)
CROP = call("crop", image="img_1", x=10, y=20, width=256, height=256)
ANSWER = fmt.assistant_text("done", response="Eiffel Tower")


def run(processor, turns: list[str], store: dict | None = None, outages: OutageConfig | None = None, seed: int = 0,
        **cfg):
    client = with_outages(ToolClient(InProcessTransport(TOOLS)), outages)
    teacher = ScriptedTeacher({QUESTION: turns})
    row = {"id": "q1", "question": QUESTION, "answer": "Eiffel Tower", "answer_aliases": ["La tour Eiffel"]}
    return asyncio.run(run_episode(teacher, row, [picture()], client, AgentConfig(**cfg), processor=processor,
                                   tools=SCHEMAS, group_id="g", image_store=store, seed=seed))


def collapse_pads(text: str) -> str:
    """Decoded ids with each run of image pads back to the one pad ``render`` writes."""
    while fmt.IMAGE_PAD * 2 in text:
        text = text.replace(fmt.IMAGE_PAD * 2, fmt.IMAGE_PAD)
    return text


def test_teacher_record_is_the_rendered_conversation(processor):
    store: dict = {}
    t = run(processor, [CROP, OK, ANSWER], store)
    assert t.kind == "teacher" and t.stop_reason == "response" and t.final_answer == "Eiffel Tower"
    assert [x.action for x in t.turns] == ["tool_call", "tool_call", "response"]
    assert t.turns[0].new_images == ["img_2"] and t.turns[0].observation.startswith("Cropped img_1")
    assert len(t.images) == 2 and set(store) == set(t.images)
    assert store[t.images[1]].shape == (256, 256, 3)
    messages = [{"role": "user", "content": QUESTION, "images": ["img_1"]},
                {"role": "assistant", "content": CROP},
                {"role": "tool", "content": t.turns[0].observation, "images": ["img_2"]},
                {"role": "assistant", "content": OK},
                {"role": "tool", "content": "probe ok"},
                {"role": "assistant", "content": ANSWER}]
    tok = processor.tokenizer
    assert collapse_pads(tok.decode(t.input_ids)) == fmt.render(messages, tools=SCHEMAS)
    # model tokens: exactly the three assistant texts, each under its turn index
    for turn, text in enumerate([CROP, OK, ANSWER]):
        ids = [i for i, s, g in zip(t.input_ids, t.step_ids, t.gen_mask, strict=True) if g and s == turn]
        assert tok.decode(ids) == text
    assert sum(t.gen_mask) == sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in [CROP, OK, ANSWER])
    # pads in the record == what the processor makes of the stored images
    grid = processor_inputs([store[h] for h in t.images], t.image_max_pixels, processor)["image_grid_thw"]
    assert t.input_ids.count(tok.convert_tokens_to_ids(fmt.IMAGE_PAD)) == int(grid.prod(dim=1).sum()) // 4
    assert t.budgets["max_turns"] == 8 and t.budgets["k"] == 3 and t.fatal_kth == -1


def test_three_failures_in_a_row_are_fatal_at_the_third(processor):
    t = run(processor, [FAIL, FAIL, FAIL, ANSWER])
    assert (t.fatal_cascade_start, t.fatal_kth, t.stop_reason) == (0, 2, "fatal")
    assert len(t.turns) == 3 and all(x.failed and x.error_kind == "tool_error" for x in t.turns)
    assert t.final_answer is None
    # stopped right after the K-th failure: its error is recorded but not fed back
    assert "Error (tool_error)" in t.turns[2].observation
    assert processor.tokenizer.decode(t.input_ids).count("Error (tool_error)") == 2


def test_a_success_resets_the_count(processor):
    t = run(processor, [FAIL, FAIL, OK, FAIL, FAIL, FAIL, ANSWER])
    assert [x.failed for x in t.turns] == [True, True, False, True, True, True]
    assert (t.fatal_cascade_start, t.fatal_kth, t.stop_reason) == (3, 5, "fatal")


def test_an_unparsable_turn_is_a_failed_invalid_call_answered_with_an_error(processor):
    t = run(processor, [FAIL, "no tags at all", FAIL])
    assert t.turns[1].action == "invalid" and t.turns[1].error_kind == "invalid_call" and t.turns[1].failed
    assert t.turns[1].observation.startswith("Error (invalid_call): missing_tag")
    assert (t.fatal_cascade_start, t.fatal_kth) == (0, 2)
    assert t.turns[1].observation in processor.tokenizer.decode(t.input_ids)


def test_continue_past_the_fatal_step_and_counted_kinds(processor):
    t = run(processor, [FAIL, FAIL, FAIL, OK, ANSWER], stop_on_fatal=False)
    assert (t.fatal_cascade_start, t.fatal_kth, t.stop_reason, t.final_answer) == (0, 2, "response", "Eiffel Tower")
    t = run(processor, [FAIL, FAIL, FAIL, ANSWER], fatal_kinds=["invalid_call"])
    assert t.fatal_kth == -1 and t.stop_reason == "response" and not any(x.failed for x in t.turns)
    assert all(x.status == "error" for x in t.turns[:3])


def test_outages_are_seeded_recorded_typed_and_fatal_in_a_burst_of_k(processor):
    cfg = OutageConfig(rate=1.0, burst=3, kind="timeout", seed=7)
    # the scripted agent calls a tool on turns 0-3 and answers on turn 4: an episode seed whose outage starts at turn 1
    seed = next(s for s in range(200) if draw_outage(cfg, s, 8).start == 1)
    t = run(processor, [OK, OK, OK, OK, ANSWER], outages=cfg, seed=seed)
    assert [x.error_kind for x in t.turns] == [None, "timeout", "timeout", "timeout"]
    assert (t.fatal_cascade_start, t.fatal_kth, t.stop_reason) == (1, 3, "fatal")
    assert "outage:turns 1-3:timeout:all" in t.events and "outage (injected" in t.turns[1].observation
    assert run(processor, [OK, OK, OK, OK, ANSWER], outages=cfg, seed=seed).events == t.events  # seeded
    # an outage of another tool, or one that ends before K failures, is not fatal; off by default
    crop_only = OutageConfig(rate=1.0, burst=3, tools=["crop"], seed=7)
    t = run(processor, [OK, OK, OK, OK, ANSWER], outages=crop_only, seed=seed)
    assert t.stop_reason == "response" and not any(x.failed for x in t.turns)
    short = OutageConfig(rate=1.0, burst=2, kind="unavailable", seed=7)
    t = run(processor, [OK, OK, OK, OK, ANSWER], outages=short, seed=seed)
    assert [x.error_kind for x in t.turns] == [None, "unavailable", "unavailable", None, None] and t.fatal_kth == -1
    assert not any(e.startswith("outage") for e in run(processor, [OK, ANSWER]).events)
    # the rate is the share of episodes with an outage, each a function of (seed, episode seed) alone
    draws = [draw_outage(OutageConfig(rate=0.3, seed=1), s, 8) for s in range(2000)]
    assert 0.26 < sum(d is not None for d in draws) / 2000 < 0.34
    assert {d.start for d in draws if d is not None} == set(range(8))
    assert draws[:50] == [draw_outage(OutageConfig(rate=0.3, seed=1), s, 8) for s in range(50)]
    assert draws[:50] != [draw_outage(OutageConfig(rate=0.3, seed=2), s, 8) for s in range(50)]
    for bad in (OutageConfig(rate=1.5), OutageConfig(burst=0), OutageConfig(kind="tool_error")):
        with pytest.raises(ConfigError):
            with_outages(ToolClient(InProcessTransport(TOOLS)), bad)


def test_turn_limit(processor):
    t = run(processor, [OK] * 5, max_turns=2)
    assert t.stop_reason == "max_turns" and len(t.turns) == 2


def test_overflowing_tool_image_is_downscaled_and_recorded(processor):
    full = run(processor, [CROP, ANSWER])
    default = full.image_max_pixels[1]  # img_2 (256x256) costs 64 tokens at this cap, 16 at a quarter, 4 at least
    answer_at = full.step_ids.index(1)  # tokens before the second turn: prompt, turn 0, tool answer with img_2
    # a tool answer fits when one generated token and the closing <|im_end|>\n (2 tokens) still fit after it
    budget = answer_at + 2
    t = run(processor, [CROP, ANSWER], max_episode_tokens=budget)
    assert t.events == [f"overflow:img_2:max_pixels {default}->{default // 4}"]
    assert t.image_max_pixels == [default, default // 4] and t.stop_reason == "response"
    assert t.step_ids.index(1) == answer_at - 48
    t = run(processor, [CROP, ANSWER], max_episode_tokens=budget, overflow="stop")
    assert t.stop_reason == "context_overflow" and t.events == ["overflow:stop"] and len(t.images) == 1
    assert t.turns[0].new_images == [] and len(t.turns) == 1
    # too small even at min_pixels (4 tokens): downscale steps, then stop
    t = run(processor, [CROP, ANSWER], max_episode_tokens=answer_at - 60 + 2)
    assert t.stop_reason == "context_overflow" and t.events[-1] == "overflow:stop"
    assert t.events[:-1] == [f"overflow:img_2:max_pixels {default}->{default // 4}",
                             f"overflow:img_2:max_pixels {default // 4}->{default // 16}"]


def test_bad_config_is_refused(processor):
    for bad in ({"overflow": "crop"}, {"k": 0}, {"fatal_kinds": ["oops"]}, {"min_pixels": 1}):
        with pytest.raises(ConfigError):
            run(processor, [ANSWER], **bad)


def test_tool_images_are_named_in_order(processor):
    t = run(processor, [CROP, call("crop", image="img_2", x=0, y=0, width=128, height=64), ANSWER])
    assert list(itertools.chain.from_iterable(x.new_images for x in t.turns)) == ["img_2", "img_3"]
    assert "as img_3" in t.turns[1].observation and len(t.images) == 3
