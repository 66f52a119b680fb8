"""The two-stage difficulty filter, run as the pipeline's filter-slot class with a real model and real tools.

Stage 1: the tiny Qwen3-VL, fine-tuned here on one planted question (plain AdamW on the
answer tokens, no tools in the prompt), answers that question without tools, so the stage
drops it. Stage 2: a planted question whose answer is in the reverse-image-search result
of its photo ("Thames", from Tower Bridge's description) is dropped. A control question
survives both.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

from osvl.agent.evaluate import NO_TOOLS_SYSTEM
from osvl.config import apply_override
from osvl.synth.difficulty import DifficultyFilter, answer_in
from osvl.synth.job import SynthConfig
from osvl.synth.pipeline import ROW_SCHEMA

TOWER_BRIDGE = "details_image_towerbridgelondon_background.jpg"
MOON = "skimage_data_moon.jpg"


def row(qid, question, answer, image):
    return {"id": qid, "question": question, "answer": answer, "answer_aliases": [], "images": [image],
            "hops": 2, "degraded": False, "degradation": "", "split": "sft",
            "provenance": {"anchor_image": image, "kg": "sample"}}


PLANTED = row("planted", "Which harbour is painted on the deck of the bridge in the image?", "Zanzibar Harbour",
              TOWER_BRIDGE)
GIVEAWAY = row("giveaway", "Which river does the bridge in the image cross?", "Thames", TOWER_BRIDGE)
CONTROL = row("control", "What crater of the subject of the image is named after a Danish astronomer?", "Tycho",
              MOON)


def test_answer_in_is_whole_words():
    assert answer_in("1. Tower Bridge — Bridge over the Thames in London", "the Thames", [])
    assert not answer_in("Thameside", "Thames", []) and answer_in("x", "nope", ["X"])


def synth_config(**difficulty: str) -> SynthConfig:
    """The synthesize job's config with ``filter.difficulty`` overridden as on its command line."""
    cfg = SynthConfig()
    for key, text in difficulty.items():
        cfg = apply_override(cfg, f"filter.difficulty.{key}", text)
    return cfg


def _finetune_on_planted(out, steps=50):
    import torch
    from PIL import Image

    from osvl import chat as fmt
    from osvl.agent.scripted import finetune
    from osvl.agent.trajectory import TrajectoryBuilder
    from osvl.kg.schema import SAMPLE_DIR
    from osvl.models.load import load_model, load_processor
    from osvl.models.tiny import tiny_checkpoint

    base = tiny_checkpoint("qwen3_vl")
    processor = load_processor(base)
    with Image.open(SAMPLE_DIR / "images" / TOWER_BRIDGE) as im:
        image = np.asarray(im.convert("RGB"))
    b = TrajectoryBuilder(processor)
    b.add_image(image)
    messages = [{"role": "system", "content": NO_TOOLS_SYSTEM},
                {"role": "user", "content": PLANTED["question"], "images": ["img_1"]}]
    b.add_text(fmt.render(messages, add_generation_prompt=True))  # the prompt of the evaluator's direct mode
    b.add_model_text(fmt.assistant_text("I remember this one.", response=PLANTED["answer"]), 0)
    record = b.build(kind="teacher", id="p", question_id="p", group_id="", question=PLANTED["question"],
                     answer=PLANTED["answer"], answer_aliases=[], turns=[])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = load_model(base, dtype="float32")
        losses = finetune(model, processor, [(record, [image])], steps=steps)
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return losses


@pytest.mark.slow
def test_stage_one_drops_what_the_model_knows_and_stage_two_what_one_search_gives(tmp_path):
    losses = _finetune_on_planted(tmp_path / "model")
    assert losses[-1] < 0.05 * losses[0]
    report = tmp_path / "report.jsonl"
    table = pa.Table.from_pylist([PLANTED, GIVEAWAY, CONTROL], schema=ROW_SCHEMA)
    kept = DifficultyFilter(synth_config(model=str(tmp_path / "model"), engine="hf", report=str(report)))(table)
    assert kept.column("id").to_pylist() == ["control"]
    counts = json.loads(report.read_text().splitlines()[-1])
    assert counts["no_tools:answered_without_tools"] == 1
    assert counts["one_image_search:answer_in_result"] == 1
    assert counts["rows"] == 3 and counts["kept"] == 1


def test_stage_two_alone_without_a_model(tmp_path):
    table = pa.Table.from_pylist([PLANTED, GIVEAWAY, CONTROL], schema=ROW_SCHEMA)
    only_search = synth_config(stages="one_image_search", report=str(tmp_path / "r"))
    assert DifficultyFilter(only_search)(table).column("id").to_pylist() == ["planted", "control"]
    # no model configured: stage 1 is skipped (and counted)
    assert DifficultyFilter(synth_config(stages="no_tools"))(table).num_rows == 3
