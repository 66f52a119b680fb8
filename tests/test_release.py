"""Export then import of the OpenSearch-VL release formats round-trips (ShareGPT SFT and RL JSONL)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from _questions import sample_questions

from osvl.agent.release import export_rl, export_sharegpt, import_rl, import_sharegpt, read_records
from osvl.agent.trajectory import read_trajectories, write_trajectories


def _rgb(path):
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def processor():
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint

    return load_processor(tiny_checkpoint("qwen3_vl"))


@pytest.mark.slow
def test_sharegpt_round_trip_of_teacher_records(tmp_path, processor):
    from osvl.agent.env import build_env
    from osvl.agent.loop import AgentConfig, run_episode
    from osvl.agent.teacher import PathOracle
    from osvl.tools.registry import all_tools

    qdir = sample_questions(str(tmp_path / "q"))
    rows = pq.read_table(qdir / "sft.parquet").to_pylist()
    # questions whose restoring tool returns a new image (a tool image must survive the trip), and plain ones
    picked = [r for r in rows
              if r["degraded"] and json.loads(r["degradation"])["undo_tool"] != "perspective_correct"][:2]
    picked += [r for r in rows if not r["degraded"]][:2]
    tools = [t.schema for t in all_tools().values()]
    store: dict[str, np.ndarray] = {}

    async def record():
        client = build_env().client
        cfg = AgentConfig(max_turns=16, max_new_tokens=512, max_episode_tokens=8192)
        out = [await run_episode(PathOracle(r), r, [_rgb(qdir / "images" / r["images"][0])], client, cfg,
                                 processor=processor, tools=tools, image_store=store) for r in picked]
        await client.close()
        return out

    trajs = asyncio.run(record())
    assert any(t.new_images for tr in trajs for t in tr.turns)
    write_trajectories(tmp_path / "run", trajs, store)
    stored = read_trajectories(tmp_path / "run")

    path = export_sharegpt(stored, tmp_path / "run" / "images", tmp_path / "release", tools)
    rec = read_records(path)
    assert [c["from"] for c in rec[0]["conversations"]][:3] == ["human", "gpt", "observation"]
    assert all(sum(c["value"].count("<image>") for c in r["conversations"]) == len(r["images"]) for r in rec)
    assert json.loads(rec[0]["tools"]) == tools

    back, images = import_sharegpt(path, processor)
    assert len(back) == len(stored)
    for a, b in zip(stored, back, strict=True):
        assert b.kind == "imported" and b.logprobs == []
        assert b.input_ids == a.input_ids and b.gen_mask == a.gen_mask and b.step_ids == a.step_ids
        assert b.images == a.images and set(b.images) <= set(images)
        assert (b.question, b.answer, b.answer_aliases, b.final_answer) == (a.question, a.answer, a.answer_aliases,
                                                                            a.final_answer)
        assert [(t.text, t.action, t.tool, t.arguments, t.status, t.observation, t.new_images) for t in b.turns] == \
               [(t.text, t.action, t.tool, t.arguments, t.status, t.observation, t.new_images) for t in a.turns]
    # and the imported records write and read back like any other
    write_trajectories(tmp_path / "imported", back, images)
    assert [t.input_ids for t in read_trajectories(tmp_path / "imported")] == [t.input_ids for t in stored]


def test_foreign_sharegpt_record_imports(tmp_path, processor):
    """A record as other tools write it: a JSON list, <image> then a newline, an error observation, no osvl ids."""
    from PIL import Image

    img = (np.arange(40 * 48 * 3) % 256).astype(np.uint8).reshape(40, 48, 3)
    Image.fromarray(img).save(tmp_path / "a.png")
    tools = [{"type": "function", "function": {"name": "text_search", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    conv = [{"from": "human", "value": "<image>\nWho built it?"},
            {"from": "gpt", "value": '<think>s</think>\n<tool_call>{"name": "text_search", "arguments": '
                                     '{"query": "tower"}}</tool_call>'},
            {"from": "observation", "value": "Error (timeout): slow"},
            {"from": "gpt", "value": "no tags here"},
            {"from": "observation", "value": "Error (invalid_call): missing_tag"},
            {"from": "gpt", "value": "<think>k</think>\n<response>Eiffel</response>"}]
    (tmp_path / "data.json").write_text(json.dumps([{"conversations": conv, "images": ["a.png"], "system": "Be brief.",
                                                     "tools": json.dumps(tools)}]))
    [t], images = import_sharegpt(tmp_path / "data.json", processor)
    assert t.question == "Who built it?" and t.final_answer == "Eiffel" and t.stop_reason == "response"
    assert [x.action for x in t.turns] == ["tool_call", "invalid", "response"]
    assert [x.error_kind for x in t.turns] == ["timeout", "invalid_call", None]
    assert len(images) == 1 and t.id == "data-0"
    text = processor.tokenizer.decode(t.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and "<tool_response>\nError (timeout): slow" in text
    gen = processor.tokenizer.decode([i for i, m in zip(t.input_ids, t.gen_mask, strict=True) if m])
    assert gen == "".join(x["value"] for x in conv if x["from"] == "gpt")


def test_rl_jsonl_round_trip(tmp_path):
    qdir = sample_questions(str(tmp_path / "q"))
    rows = pq.read_table(qdir / "sft.parquet").to_pylist()[:5]
    path = export_rl(rows, qdir / "images", tmp_path / "release")
    assert set(read_records(path)[0]) == {"id", "question", "answer", "images"}
    back = import_rl(path)
    assert [(r["id"], r["question"], r["answer"]) for r in back] == [(r["id"], r["question"], r["answer"])
                                                                    for r in rows]
    for a, b in zip(rows, back, strict=True):
        assert [_rgb(p).tobytes() for p in b["images"]] == [_rgb(qdir / "images" / n).tobytes() for n in a["images"]]
