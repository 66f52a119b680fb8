"""osvl.train.batch: collate pads records with their pixels, truncation never splits an image,
token_logprobs is the model's own log-softmax of the next token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osvl import chat as fmt
from osvl.agent.trajectory import TrajectoryBuilder, processor_inputs, write_trajectories
from osvl.errors import DataError
from osvl.models.load import load_model, load_processor
from osvl.models.tiny import tiny_checkpoint
from osvl.train.batch import collate, cut_point, ensure_image, image_spans, token_logprobs


@pytest.fixture(scope="module")
def tiny():
    path = tiny_checkpoint("qwen3_vl")
    return load_model(path, dtype="float32").eval(), load_processor(path)


def _image(seed: int, h: int = 64, w: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def _record(processor, n_images: int, question: str, answer_turns: int, qid: str, seed: int):
    """A teacher-style record: user turn with images, assistant turns (gen 1), tool turns (gen 0)."""
    b = TrajectoryBuilder(processor)
    names = [f"img_{i + 1}" for i in range(n_images)]
    images = [_image(seed + i) for i in range(n_images)]
    for arr in images:
        b.add_image(arr)
    b.add_text(fmt.render([{"role": "user", "content": question, "images": names}], add_generation_prompt=True))
    for t in range(answer_turns):
        b.add_model_text(fmt.assistant_text(f"step {t}", tool_call={"name": "text_search",
                                                                   "arguments": {"query": f"q{t}"}}), t)
        b.add_text(fmt.IM_END + "\n" + fmt.render([{"role": "tool", "content": f"result {t}"}])
                   + fmt.IM_START + "assistant\n")
    b.add_model_text(fmt.assistant_text("done", response="42"), answer_turns)
    b.add_text(fmt.IM_END + "\n")
    tr = b.build(kind="teacher", id=f"t{seed}", question_id=qid, group_id="", question=question, answer="42",
                 answer_aliases=[], turns=[])
    return tr, {h: a for h, a in zip(tr.images, images, strict=True)}


@pytest.fixture(scope="module")
def records(tiny, tmp_path_factory):
    _, processor = tiny
    out = tmp_path_factory.mktemp("trajs")
    recs, imgs = [], {}
    for k, (n_img, turns) in enumerate([(1, 1), (2, 2), (0, 0), (1, 3)]):
        tr, im = _record(processor, n_img, f"question number {k}?", turns, f"q{k}", 10 * k)
        recs.append(tr)
        imgs.update(im)
    write_trajectories(out, recs, imgs)
    return recs, out / "images"


def test_collate_pads_and_rebuilds_pixels(tiny, records):
    _, processor = tiny
    recs, image_dir = records
    batch = collate(recs, image_dir, processor, max_len=4096)
    lens = [len(r.input_ids) for r in recs]
    assert batch["input_ids"].shape == (4, max(lens))
    assert batch["n_tokens"].tolist() == lens
    assert batch["truncated"].tolist() == [0, 0, 0, 0] and int(batch["n_dropped"]) == 0
    for b, r in enumerate(recs):
        n = lens[b]
        assert batch["input_ids"][b, :n].tolist() == r.input_ids
        assert batch["gen_mask"][b, :n].tolist() == r.gen_mask
        assert batch["attention_mask"][b, n:].sum() == 0 and batch["gen_mask"][b, n:].sum() == 0
        assert batch["step_ids"][b, n:].eq(-1).all()
    # pixels: every image of every row, in row order, exactly what processor_inputs makes
    from osvl.agent.trajectory import load_image

    shas = [s for r in recs for s in r.images]
    ref = processor_inputs([load_image(image_dir, s) for s in shas], [r for x in recs for r in x.image_max_pixels],
                           processor)
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
    pad = processor.tokenizer.convert_tokens_to_ids(fmt.IMAGE_PAD)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == pad).long())


def test_truncation_cut_never_splits_an_image(tiny, records):
    _, processor = tiny
    recs, image_dir = records
    tok = processor.tokenizer
    v_start, v_end = (tok.convert_tokens_to_ids(t) for t in (fmt.VISION_START, fmt.VISION_END))
    two = recs[1]  # two images at the start
    (s1, e1), (s2, e2) = image_spans(two.input_ids, v_start, v_end)
    inside = (s2 + e2) // 2
    assert cut_point(two.input_ids, inside, v_start, v_end) == s2
    assert cut_point(two.input_ids, e2 + 5, v_start, v_end) == e2 + 5
    # a cut inside the second image keeps only the first one; too little left to train on: dropped
    batch = collate([two], image_dir, processor, max_len=inside, truncation="cut")
    assert int(batch["n_dropped"]) == 1 and batch["input_ids"].shape[0] == 0
    long_len = len(recs[3].input_ids) - 5
    batch = collate([recs[3]], image_dir, processor, max_len=long_len, truncation="cut")
    assert batch["truncated"].tolist() == [1] and batch["n_tokens"].tolist() == [long_len]
    assert batch["image_grid_thw"].shape[0] == 1
    batch = collate(recs, image_dir, processor, max_len=long_len, truncation="drop")
    assert int(batch["n_dropped"]) == 1 and batch["input_ids"].shape[0] == 3
    with pytest.raises(DataError):
        collate(recs, image_dir, processor, max_len=10, truncation="middle")


@pytest.mark.slow
def test_token_logprobs_match_a_plain_forward(tiny, records):
    model, processor = tiny
    recs, image_dir = records
    batch = collate(recs, image_dir, processor, max_len=4096)
    with torch.no_grad():
        lp = token_logprobs(model, batch)
        lp_t = token_logprobs(model, batch, temperature=0.7)
        # each row alone, unpadded: right padding must not change a row's log-probs
        for b, r in enumerate(recs):
            one = collate([r], image_dir, processor, max_len=4096)
            logits = model(**{k: one[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                                  "mm_token_type_ids") if k in one}).logits[0].float()
            ids = one["input_ids"][0]
            ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
            ref_t = torch.log_softmax(logits[:-1] / 0.7, -1).gather(-1, ids[1:, None]).squeeze(-1)
            n = len(r.input_ids)
            assert lp[b, 0] == 0
            assert torch.allclose(lp[b, 1:n], ref, atol=1e-4), (lp[b, 1:n] - ref).abs().max()
            assert torch.allclose(lp_t[b, 1:n], ref_t, atol=1e-4)
    assert lp.shape == batch["input_ids"].shape and (lp <= 0).all()


def test_ensure_image_changes_no_real_logprob(tiny, records):
    """The blank image ZeRO needs in image-less batches sits after row 0's tokens and moves nothing."""
    model, processor = tiny
    recs, image_dir = records
    batch = collate([recs[2], recs[0]], image_dir, processor, max_len=4096)  # row 0 has no image, row 1 one
    text_only = collate([recs[2]], image_dir, processor, max_len=4096)
    assert "pixel_values" not in text_only
    padded = ensure_image(text_only, processor)
    assert ensure_image(batch, processor) is batch
    n = int(text_only["n_tokens"][0])
    assert padded["input_ids"].shape[1] > n and padded["gen_mask"][0, n:].sum() == 0
    assert padded["image_grid_thw"].shape == (1, 3)
    with torch.no_grad():
        a = token_logprobs(model, text_only)[0, :n]
        b = token_logprobs(model, padded)[0, :n]
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
