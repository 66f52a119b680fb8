"""The tiny VLMs end to end: chat format -> processor -> model -> generation -> parse, on real photos."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from osvl import chat as fmt
from osvl.errors import PARSE_ERROR_KINDS, ParseError
from osvl.models import tiny
from osvl.models.load import load_model, load_processor

TOOLS = [{"type": "function", "function": {"name": "image_search", "description": "Find pages showing an image.",
                                           "parameters": {"type": "object", "properties": {"image": {"type": "string"}},
                                                          "required": ["image"]}}}]


@pytest.fixture(scope="module", params=tiny.KINDS)
def tiny_vlm(request):
    path = tiny.tiny_checkpoint(request.param)
    return path, load_processor(path), load_model(path)


@pytest.fixture(scope="module")
def photo(shared_data) -> np.ndarray:
    """A real photo (the Colosseum, 1024x666) from the shared data, as uint8 RGB."""
    manifest = json.loads((shared_data / "images" / "gcompris" / "manifest.json").read_text())
    entry = next(e for e in manifest if e["name"] == "Colosseum")
    return np.asarray(Image.open(shared_data / "images" / "gcompris" / entry["image"]).convert("RGB"))


def question(images: int = 1) -> str:
    return fmt.render([{"role": "user", "content": "When was the building in the image finished?",
                        "images": [f"img_{i + 1}" for i in range(images)]}], tools=TOOLS, add_generation_prompt=True)


def test_generate_and_parse_a_turn_about_a_photo(tiny_vlm, photo):
    _, processor, model = tiny_vlm
    inputs = processor(images=[photo], text=[question()], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 24
    text = processor.tokenizer.decode(new, skip_special_tokens=False)
    try:  # random weights: garbage text is expected, but it must go through the real parser
        turn = fmt.parse_turn(text, [t["function"]["name"] for t in TOOLS])
        assert turn.action in ("tool_call", "response")
    except ParseError as e:
        assert e.kind in PARSE_ERROR_KINDS


def test_image_tokens_match_the_grid(tiny_vlm, photo):
    _, processor, model = tiny_vlm
    inputs = processor(images=[photo, photo[::2, ::2]], text=[question(images=2)], return_tensors="pt")
    grid = inputs["image_grid_thw"]
    merge = processor.image_processor.merge_size
    n_pad = (inputs["input_ids"] == model.config.image_token_id).sum().item()
    assert n_pad == int(grid.prod(dim=1).sum()) // merge**2
    assert inputs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    assert n_pad <= 2 * tiny.MAX_TOKENS  # the tiny image processor keeps photos cheap
    # one vision-start/end pair per image, around its run of pads
    assert (inputs["input_ids"] == model.config.vision_start_token_id).sum() == 2


def test_pixels_reach_the_model(tiny_vlm, photo):
    _, processor, model = tiny_vlm
    text = question()
    with torch.no_grad():
        logits = model(**processor(images=[photo], text=[text], return_tensors="pt")).logits
        again = model(**processor(images=[photo], text=[text], return_tensors="pt")).logits
        changed = photo.copy()
        changed[: photo.shape[0] // 2] = 255 - changed[: photo.shape[0] // 2]
        other = model(**processor(images=[changed], text=[text], return_tensors="pt")).logits
    torch.testing.assert_close(logits, again, rtol=0, atol=0)  # deterministic, so a difference means something
    assert other.shape == logits.shape
    assert (other[0, -1] - logits[0, -1]).abs().max() > 1e-3


def test_gradients_reach_the_vision_tower(tiny_vlm, photo):
    _, processor, model = tiny_vlm
    inputs = processor(images=[photo], text=[question() + "<think>x</think>\n<response>y</response><|im_end|>"],
                       return_tensors="pt")
    model.zero_grad()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    vision = [p.grad for n, p in model.named_parameters() if "visual" in n]
    assert vision and all(g is not None for g in vision)
    assert sum(g.abs().sum().item() for g in vision) > 0
    model.zero_grad()


def test_reloaded_processor_gives_the_same_inputs(tiny_vlm, photo, tmp_path):
    """The built-in-memory processor, and one saved and loaded back, produce identical inputs."""
    path, processor, model = tiny_vlm
    kind = json.loads((path / "config.json").read_text())["model_type"]
    fresh_cls = type(processor)
    fresh = fresh_cls(image_processor=tiny.image_processor(kind), tokenizer=tiny.train_tokenizer(),
                      chat_template=fmt.CHAT_TEMPLATE)
    # a second round trip through save_pretrained, as a user fine-tuning the model would do
    processor.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    reloaded = load_processor(tmp_path)
    text = question()
    want = fresh(images=[photo], text=[text], return_tensors="pt")
    for other in (processor, reloaded):
        got = other(images=[photo], text=[text], return_tensors="pt")
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    with torch.no_grad():
        logits = model(**reloaded(images=[photo], text=[text], return_tensors="pt")).logits
    assert logits.shape == (1, want["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_chat_template_renders_like_render(tiny_vlm):
    _, processor, _ = tiny_vlm
    messages = [{"role": "user", "content": "What is this?", "images": ["img_1"]},
                {"role": "assistant", "content": fmt.assistant_text("look", tool_call={"name": "image_search",
                                                                                     "arguments": {"image": "img_1"}})},
                {"role": "tool", "content": "1. Colosseum — ancient amphitheatre in Rome", "images": ["img_2"]}]
    via_template = processor.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert via_template == fmt.render(messages, tools=TOOLS, add_generation_prompt=True)
