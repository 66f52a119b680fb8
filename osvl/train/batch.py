"""Trajectory records -> padded training tensors, and per-token log-probs of a model on them.

Both SFT and the GRPO learner train on the records' own token ids and the pixels rebuilt from
the stored images through ``osvl.agent.trajectory.processor_inputs`` (the one function the
engine used too), never on re-rendered text: what the model is trained on is exactly what it
saw or produced.

Truncation (``max_len``), a policy recorded per row in ``truncated``:

* ``"drop"``: a record longer than ``max_len`` is left out of the batch (``n_dropped`` counts
  them). Nothing the model produced is ever cut; the right choice for RL, where a cut
  trajectory's reward would no longer match its tokens.
* ``"cut"``: keep the first ``max_len`` tokens, but never half an image: when the cut falls
  inside an image's ``<|vision_start|> <|image_pad|>... <|vision_end|>`` run, the row ends
  before that ``<|vision_start|>`` and the image is not fed. The right choice for SFT of long
  teacher trajectories: the early turns still teach.

Rows are right-padded; ``attention_mask`` is 0 on padding and ``gen_mask`` is 0 there too, so
losses that weight by ``gen_mask`` never see a pad.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from osvl.agent.trajectory import load_image, mm_token_type_ids, processor_inputs
from osvl.chat import IMAGE_PAD, VISION_END, VISION_START
from osvl.errors import DataError
from osvl.train import device

Truncation = Literal["drop", "cut"]
TRUNCATION = get_args(Truncation)


def _vision_ids(processor) -> tuple[int, int, int]:
    tok = getattr(processor, "tokenizer", processor)
    return tuple(int(tok.convert_tokens_to_ids(t)) for t in (VISION_START, IMAGE_PAD, VISION_END))


def image_spans(ids: Sequence[int], vision_start: int, vision_end: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each image in ``ids``: start at ``<|vision_start|>``, end after ``<|vision_end|>``."""
    spans, open_at = [], -1
    for i, t in enumerate(ids):
        if t == vision_start:
            open_at = i
        elif t == vision_end and open_at >= 0:
            spans.append((open_at, i + 1))
            open_at = -1
    return spans


def cut_point(ids: Sequence[int], max_len: int, vision_start: int, vision_end: int) -> int:
    """Length to keep under the ``cut`` policy: ``max_len``, moved before an image the cut would split."""
    if len(ids) <= max_len:
        return len(ids)
    for start, end in image_spans(ids, vision_start, vision_end):
        if start < max_len < end:
            return start
    return max_len


def collate(trajs: Sequence[Any], image_dir: str | Path, processor, max_len: int,
            truncation: str = "cut") -> dict[str, torch.Tensor]:
    """Pad a list of ``Trajectory`` records into one batch (see the module docstring for truncation).

    Returns ``input_ids, attention_mask, gen_mask, step_ids, old_logprobs`` (B, T), ``n_tokens``
    and ``truncated`` (B,), ``n_dropped`` (scalar), and, when any kept row has an image,
    ``pixel_values`` and ``image_grid_thw`` for every kept image in row order (the order
    Qwen-VL models consume them in) with ``mm_token_type_ids`` (B, T), which transformers 5
    needs for the M-RoPE positions of image tokens. ``old_logprobs`` is 0 where a record has none
    (teacher/imported records).
    """
    if truncation not in TRUNCATION:
        raise DataError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    if max_len < 1:
        raise DataError(f"max_len must be >= 1, got {max_len}")
    v_start, v_pad, v_end = _vision_ids(processor)
    tok = getattr(processor, "tokenizer", processor)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows, images, max_pixels = [], [], []
    dropped = 0
    for tr in trajs:
        ids = list(tr.input_ids)
        if not (len(ids) == len(tr.gen_mask) == len(tr.step_ids)):
            raise DataError(f"trajectory {tr.id}: input_ids, gen_mask and step_ids differ in length")
        if tr.logprobs and len(tr.logprobs) != len(ids):
            raise DataError(f"trajectory {tr.id}: {len(tr.logprobs)} logprobs for {len(ids)} tokens")
        n = len(ids)
        if n > max_len:
            if truncation == "drop":
                dropped += 1
                continue
            n = cut_point(ids, max_len, v_start, v_end)
            if n == 0 or not any(tr.gen_mask[:n]):
                dropped += 1  # nothing left to train on
                continue
        spans = [s for s in image_spans(ids[:n], v_start, v_end)]
        if len(spans) > len(tr.images):
            raise DataError(f"trajectory {tr.id}: {len(spans)} images in the tokens, {len(tr.images)} recorded")
        for k in range(len(spans)):
            images.append(load_image(image_dir, tr.images[k]))
            max_pixels.append(int(tr.image_max_pixels[k]))
        rows.append((tr, n, n < len(ids)))
    batch_size = len(rows)
    width = max((n for _, n, _ in rows), default=0)
    out = {
        "input_ids": torch.full((batch_size, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((batch_size, width), dtype=torch.long),
        "gen_mask": torch.zeros((batch_size, width), dtype=torch.float32),
        "step_ids": torch.full((batch_size, width), -1, dtype=torch.long),
        "old_logprobs": torch.zeros((batch_size, width), dtype=torch.float32),
        "n_tokens": torch.zeros(batch_size, dtype=torch.long),
        "truncated": torch.zeros(batch_size, dtype=torch.long),
        "n_dropped": torch.tensor(dropped, dtype=torch.long),
    }
    for b, (tr, n, cut) in enumerate(rows):
        out["input_ids"][b, :n] = torch.tensor(tr.input_ids[:n], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
        out["gen_mask"][b, :n] = torch.tensor(tr.gen_mask[:n], dtype=torch.float32)
        out["step_ids"][b, :n] = torch.tensor(tr.step_ids[:n], dtype=torch.long)
        if tr.logprobs:
            out["old_logprobs"][b, :n] = torch.tensor(tr.logprobs[:n], dtype=torch.float32)
        out["n_tokens"][b] = n
        out["truncated"][b] = int(cut)
    if images:
        pix = processor_inputs(images, max_pixels, processor)
        out["pixel_values"] = torch.as_tensor(pix["pixel_values"])
        out["image_grid_thw"] = torch.as_tensor(pix["image_grid_thw"], dtype=torch.long)
        out["mm_token_type_ids"] = mm_token_type_ids(out["input_ids"], v_pad)
        merge = int(getattr(processor.image_processor, "merge_size", 2))
        expected = int((out["image_grid_thw"].prod(-1) // (merge * merge)).sum())
        got = int((out["input_ids"] == v_pad).sum())
        if expected != got:
            raise DataError(f"{got} <|image_pad|> tokens in the batch but the rebuilt pixels make {expected}: "
                            "the records' image_max_pixels or processor settings do not match this processor")
    return out


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keys of a collated batch that the model's ``forward`` takes."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    return {k: batch[k] for k in keys if k in batch}


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log-prob of token t under ``model`` given tokens < t, from ``logits / temperature``.

    Position 0 has no context and gets 0. Computed as gathered logit minus ``logsumexp`` in
    float32, which avoids materialising a second (B, T, V) tensor for ``log_softmax``. The
    values at padding positions are meaningless; mask them with ``attention_mask``/``gen_mask``.
    """
    if temperature <= 0:
        raise DataError(f"temperature must be > 0 for log-probs, got {temperature}")

    inputs = device.to_model(model_inputs(batch), model)  # pixels in the weights' dtype (bf16 on GPU)
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    target = inputs["input_ids"][:, 1:]
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


def masked_nll(logp: torch.Tensor, gen_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of -log p over gen-mask tokens, number of those tokens): SFT's loss numerator and divisor."""
    mask = gen_mask.to(logp.device, logp.dtype)  # a (B, T) host mask beside the model's log-probs
    return -(logp * mask).sum(), mask.sum()



def ensure_image(batch: dict[str, torch.Tensor], processor) -> dict[str, torch.Tensor]:
    """Give an image-less batch one blank 32x32 image, appended after row 0's last token.

    Why: under DeepSpeed ZeRO every rank must reduce the same gradients in the same order
    (ZeRO-2/3 reduce in the order backward hooks fire). A micro-batch without images leaves the
    vision tower out of the graph on that rank only, and the ranks' collectives stop matching
    (gloo aborts, NCCL hangs). Appended at the end of a row with ``gen_mask`` 0, the image
    changes no logit of a real token (attention is causal and the positions before it are
    unchanged), yet every forward now runs embed -> vision tower -> language model in the same
    structure, so the hooks fire in the same order on every rank.
    """
    if "pixel_values" in batch or batch["input_ids"].shape[0] == 0:
        return batch

    v_start, v_pad, v_end = _vision_ids(processor)
    ip = processor.image_processor
    pix = processor_inputs([np.zeros((32, 32, 3), np.uint8)], [int(ip.size["longest_edge"])], processor)
    n_pad = int(pix["image_grid_thw"].prod()) // int(ip.merge_size) ** 2
    ids = torch.tensor([v_start] + [v_pad] * n_pad + [v_end], dtype=torch.long)
    at = int(batch["n_tokens"][0])
    need = at + len(ids) - batch["input_ids"].shape[1]
    out = dict(batch)
    if need > 0:
        tok = getattr(processor, "tokenizer", processor)
        fills = {"input_ids": tok.pad_token_id or 0, "step_ids": -1}
        for key in ("input_ids", "attention_mask", "gen_mask", "step_ids", "old_logprobs"):
            x = out[key]
            pad = torch.full((x.shape[0], need), fills.get(key, 0), dtype=x.dtype)
            out[key] = torch.cat([x, pad], dim=1)
    out["input_ids"] = out["input_ids"].clone()
    out["attention_mask"] = out["attention_mask"].clone()
    out["input_ids"][0, at:at + len(ids)] = ids
    out["attention_mask"][0, at:at + len(ids)] = 1
    out["pixel_values"] = pix["pixel_values"]
    out["image_grid_thw"] = pix["image_grid_thw"].to(torch.long)
    out["mm_token_type_ids"] = mm_token_type_ids(out["input_ids"], v_pad)
    return out
