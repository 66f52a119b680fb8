"""Token-in/token-out trajectory records: the dataclasses, their Parquet form, and the builder.

A trajectory is what training needs to reproduce an episode exactly: the token ids the
engine consumed and produced (image pads already expanded), which of them the model
produced (``gen_mask``) with their behaviour log-probs, which assistant turn each token
belongs to, and the images by content hash so the pixels can be rebuilt. Training never
re-renders text: it feeds ``input_ids`` as stored, and ``processor_inputs`` is the one
function that turns images into ``pixel_values`` for both the engine and the trainer, so
"the pixels training sees == the pixels the engine saw" holds by construction.

Storage: ``<out>/trajectories.parquet/part-NNNNN.parquet`` (a directory of numbered parts,
so writers append without rewriting; ``pyarrow.parquet.read_table`` and pandas read the
directory as one table) plus ``<out>/images/<sha256>.png``, each image once, named by the
sha256 of its PNG bytes. Free-form dicts (tool arguments, budgets, processor settings) are
JSON strings in Parquet, so the schema stays fixed whatever a tool takes as arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from osvl.chat import IMAGE_PAD
from osvl.errors import DataError
from osvl.storage import atomic_write, write_once

KINDS = ("policy", "teacher", "imported")
STOP_REASONS = ("response", "max_turns", "max_tokens", "fatal", "context_overflow")


@dataclass
class Turn:
    """One assistant turn and what answered it."""

    index: int
    text: str
    action: str  # "tool_call" | "response" | "invalid" (did not parse)
    tool: str | None = None
    arguments: dict | None = None
    status: str = ""  # "ok" | "error" ("" for response turns)
    error_kind: str | None = None  # invalid_call | tool_error | timeout | unavailable
    failed: bool = False  # counts toward the K-consecutive-failures rule
    policy_version: int = -1  # -1 for teacher/imported turns
    observation: str = ""  # the tool-response text given back to the model
    new_images: list[str] = field(default_factory=list)  # names img_k this turn's tool produced


@dataclass
class Trajectory:
    """One episode, token-exact (see the module docstring and docs/design.md)."""

    id: str
    question_id: str
    group_id: str
    kind: str
    question: str
    answer: str
    answer_aliases: list[str]
    input_ids: list[int]
    gen_mask: list[int]
    logprobs: list[float]
    step_ids: list[int]
    images: list[str]
    image_max_pixels: list[int]
    processor: dict
    turns: list[Turn]
    fatal_cascade_start: int = -1
    fatal_kth: int = -1
    stop_reason: str = ""
    events: list[str] = field(default_factory=list)
    budgets: dict = field(default_factory=dict)
    final_answer: str | None = None
    r_fmt: float = 0.0
    r_acc: float = 0.0
    r_query: float = 0.0
    reward: float = 0.0
    judge_status: str = "ok"
    model: str = ""
    seed: int = 0
    temperature: float = 1.0

    @property
    def fatal(self) -> bool:
        return self.fatal_kth >= 0

    def check(self) -> None:
        """Raise ``DataError`` when the per-token lists disagree (a record training cannot use)."""
        n = len(self.input_ids)
        if self.kind not in KINDS:
            raise DataError(f"trajectory {self.id}: kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.gen_mask) != n or len(self.step_ids) != n:
            raise DataError(f"trajectory {self.id}: gen_mask/step_ids lengths differ from input_ids ({n})")
        if self.logprobs and len(self.logprobs) != n:
            raise DataError(f"trajectory {self.id}: {len(self.logprobs)} logprobs for {n} tokens")
        if self.kind == "policy" and not self.logprobs:
            raise DataError(f"trajectory {self.id}: a policy record needs behaviour log-probs")
        if len(self.images) != len(self.image_max_pixels):
            raise DataError(f"trajectory {self.id}: {len(self.images)} images, "
                            f"{len(self.image_max_pixels)} max_pixels entries")


# ---------------------------------------------------------------------------
# Parquet schema: explicit, so every writer (loop, teacher job, importers) produces the same table.


def _schema():
    turn = pa.struct([
        ("index", pa.int32()), ("text", pa.string()), ("action", pa.string()), ("tool", pa.string()),
        ("arguments", pa.string()),  # JSON
        ("status", pa.string()), ("error_kind", pa.string()), ("failed", pa.bool_()),
        ("policy_version", pa.int64()), ("observation", pa.string()), ("new_images", pa.list_(pa.string())),
    ])
    return pa.schema([
        ("id", pa.string()), ("question_id", pa.string()), ("group_id", pa.string()), ("kind", pa.string()),
        ("question", pa.string()), ("answer", pa.string()), ("answer_aliases", pa.list_(pa.string())),
        ("input_ids", pa.list_(pa.int32())), ("gen_mask", pa.list_(pa.int8())),
        # logprobs as float32: its rounding (~1e-7) is far below the 1e-4 re-score bar
        ("logprobs", pa.list_(pa.float32())), ("step_ids", pa.list_(pa.int32())),
        ("images", pa.list_(pa.string())), ("image_max_pixels", pa.list_(pa.int64())),
        ("processor", pa.string()),  # JSON
        ("turns", pa.list_(turn)),
        ("fatal_cascade_start", pa.int32()), ("fatal_kth", pa.int32()), ("stop_reason", pa.string()),
        ("events", pa.list_(pa.string())), ("budgets", pa.string()),  # JSON
        ("final_answer", pa.string()),
        ("r_fmt", pa.float64()), ("r_acc", pa.float64()), ("r_query", pa.float64()), ("reward", pa.float64()),
        ("judge_status", pa.string()), ("model", pa.string()), ("seed", pa.int64()), ("temperature", pa.float64()),
    ])


_JSON_FIELDS = ("processor", "budgets")


def _to_row(t: Trajectory) -> dict[str, Any]:
    t.check()
    row = dataclasses.asdict(t)
    for k in _JSON_FIELDS:
        row[k] = json.dumps(row[k], sort_keys=True)
    for turn in row["turns"]:
        turn["arguments"] = None if turn["arguments"] is None else json.dumps(turn["arguments"], ensure_ascii=False)
    return row


def _from_row(row: dict[str, Any]) -> Trajectory:
    row = dict(row)
    for k in _JSON_FIELDS:
        row[k] = json.loads(row[k]) if row[k] else {}
    turns = []
    for turn in row["turns"] or []:
        turn = dict(turn)
        turn["arguments"] = None if turn["arguments"] is None else json.loads(turn["arguments"])
        turn["new_images"] = list(turn["new_images"] or [])
        turns.append(Turn(**turn))
    row["turns"] = turns
    for k in ("answer_aliases", "input_ids", "gen_mask", "logprobs", "step_ids", "images", "image_max_pixels",
              "events"):
        row[k] = list(row[k] or [])
    return Trajectory(**row)


# ---------------------------------------------------------------------------
# images, stored once by content hash


def png_bytes(arr: np.ndarray) -> bytes:
    """Lossless, deterministic PNG of an RGB uint8 array (fixed encoder settings, so the hash is stable)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise DataError(f"expected an RGB uint8 image, got {type(arr).__name__} {getattr(arr, 'shape', '')}")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def image_hash(arr: np.ndarray) -> str:
    """sha256 hex of the image's PNG bytes: its name in ``images/``."""
    return hashlib.sha256(png_bytes(arr)).hexdigest()


def load_image(image_dir: str | Path, sha: str) -> np.ndarray:
    """The RGB uint8 array stored as ``image_dir/<sha>.png``."""
    path = Path(image_dir) / f"{sha}.png"
    if not path.is_file():
        raise DataError(f"image {sha} is not stored in {image_dir}")
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def write_trajectories(out_dir: str | Path, trajs: Sequence[Trajectory], images: Mapping[str, np.ndarray]) -> Path:
    """Append ``trajs`` as a new numbered part of ``out_dir/trajectories.parquet`` and store new images once.

    ``images`` maps content hash -> array and must hold every hash the trajectories name
    (images already stored are not rewritten). Parts are written to a temporary name and
    renamed, so a reader never sees half a part. Returns the part written.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    table_dir = out_dir / "trajectories.parquet"
    table_dir.mkdir(exist_ok=True)
    for t in trajs:
        for sha in t.images:
            path = out_dir / "images" / f"{sha}.png"
            if path.is_file():
                continue
            if sha not in images:
                raise DataError(f"trajectory {t.id} names image {sha} but it was not given to write_trajectories")
            write_once(path, png_bytes(images[sha]))
    table = pa.Table.from_pylist([_to_row(t) for t in trajs], schema=_schema())
    while True:  # numbered parts; exclusive create settles races between writers
        n = len(list(table_dir.glob("part-*.parquet")))
        part = table_dir / f"part-{n:05d}.parquet"
        try:
            fd = os.open(part, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        break
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write(part, sink.getvalue().to_pybytes())
    return part


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Every trajectory under ``path``: a run folder, its ``trajectories.parquet`` directory, or one part file."""
    path = Path(path)
    if path.is_dir() and (path / "trajectories.parquet").exists():
        path = path / "trajectories.parquet"
    files = sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise DataError(f"no trajectory parquet at {path}")
    out = []
    for f in files:
        if f.stat().st_size == 0:  # a part whose writer has reserved the name but not finished
            continue
        out.extend(_from_row(r) for r in pq.read_table(f, schema=_schema()).to_pylist())
    return out


# ---------------------------------------------------------------------------
# pixels: the one path from images to model inputs


def _image_processor(processor: Any) -> Any:
    return getattr(processor, "image_processor", processor)


def processor_settings(processor: Any) -> dict[str, Any]:
    """The image-processing settings recorded in ``Trajectory.processor`` (enough to rebuild the processor)."""
    ip = _image_processor(processor)
    return {
        "class": type(ip).__name__,
        "min_pixels": int(ip.size["shortest_edge"]), "max_pixels": int(ip.size["longest_edge"]),
        "patch_size": int(ip.patch_size), "merge_size": int(ip.merge_size),
        "temporal_patch_size": int(ip.temporal_patch_size),
        "image_mean": [float(x) for x in ip.image_mean], "image_std": [float(x) for x in ip.image_std],
    }


def _size(processor: Any, max_pixels: int) -> dict[str, int]:
    ip = _image_processor(processor)
    # min_pixels may not exceed max_pixels (smart_resize would upscale past the cap)
    return {"shortest_edge": min(int(ip.size["shortest_edge"]), int(max_pixels)), "longest_edge": int(max_pixels)}


def processor_inputs(images: Sequence[np.ndarray], max_pixels: Sequence[int], processor: Any) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` of ``images``, each resized under its own ``max_pixels``.

    The HF engine and training both call this, with the arrays loaded back from the PNGs
    (lossless), so the pixels match bit for bit. Images are processed one by one because
    each may have its own pixel cap (the overflow policy lowers it for late tool images).
    """
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    if len(images) != len(max_pixels):
        raise DataError(f"{len(images)} images but {len(max_pixels)} max_pixels values")
    if not images:
        return {"pixel_values": None, "image_grid_thw": None}
    ip = _image_processor(processor)
    pix, grids = [], []
    for arr, mp in zip(images, max_pixels, strict=True):
        out = ip(images=[arr], size=_size(processor, mp), return_tensors="pt")
        pix.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    return {"pixel_values": torch.cat(pix).to(torch.float32), "image_grid_thw": torch.cat(grids)}


def mm_token_type_ids(input_ids: Any, image_token_id: int) -> Any:
    """1 on image pads, 0 elsewhere: the modality map Qwen-VL models in transformers 5 need for M-RoPE.

    Pass it to every forward and ``generate`` that carries images. Without it ``forward``
    raises, but ``generate`` silently falls back to 1-D text positions, so the engine and a
    training forward would disagree about every token after the first image.
    """
    return (input_ids == image_token_id).to(input_ids.dtype)


def image_token_count(arr: np.ndarray, max_pixels: int, processor: Any) -> int:
    """How many ``<|image_pad|>`` tokens ``arr`` expands to under ``max_pixels`` (no pixels computed)."""
    ip = _image_processor(processor)
    size = _size(processor, max_pixels)
    patches = ip.get_number_of_image_patches(
        arr.shape[0], arr.shape[1], {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]})
    return patches // int(ip.merge_size) ** 2


# ---------------------------------------------------------------------------


class TrajectoryBuilder:
    """Accumulates one episode's tokens, masks, log-probs and images.

    Text segments (system, user, tool, chat-template glue) go in with ``gen=0``; model
    segments go in with ``gen=1``, their log-probs and their turn index. Any
    ``<|image_pad|>`` in a text segment is expanded to the image's token count, for the
    next image in order of appearance, exactly as the processor would expand it, so
    ``input_ids`` is what the engine consumes. Segments are tokenized one at a time:
    that *defines* the record's tokens (the engine consumes these same ids), and since
    every boundary sits next to a special token, it matches tokenizing the whole text.
    """

    def __init__(self, processor: Any, default_max_pixels: int | None = None) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.pad_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        settings = processor_settings(processor)
        self.settings = settings
        self.default_max_pixels = int(default_max_pixels or settings["max_pixels"])
        self.input_ids: list[int] = []
        self.gen_mask: list[int] = []
        self.logprobs: list[float] = []
        self.step_ids: list[int] = []
        self.images: list[np.ndarray] = []  # arrays, in order of appearance
        self.image_max_pixels: list[int] = []
        self._placed = 0  # images whose pads are already in input_ids

    def __len__(self) -> int:
        return len(self.input_ids)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def add_image(self, arr: np.ndarray, max_pixels: int | None = None) -> int:
        """Register the next image; the next ``<|image_pad|>`` in a text places it. Returns its token count."""
        mp = int(max_pixels or self.default_max_pixels)
        self.images.append(arr)
        self.image_max_pixels.append(mp)
        return image_token_count(arr, mp, self.processor)

    def text_ids(self, text: str) -> list[int]:
        """Token ids of a gen-0 text, pads expanded for the pending images (does not append)."""
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 > len(self.images) - self._placed:
            raise DataError(f"text has {len(pieces) - 1} image pads but only {len(self.images) - self._placed} "
                            "images are registered and unplaced")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids.extend(self.tokenize(piece))
            if i < len(pieces) - 1:
                k = self._placed + i
                ids.extend([self.pad_id] * image_token_count(self.images[k], self.image_max_pixels[k], self.processor))
        return ids

    def add_text(self, text: str) -> list[int]:
        """Append a gen-0 segment (template, user, tool text); returns its ids."""
        ids = self.text_ids(text)
        self._placed += text.count(IMAGE_PAD)
        self._extend(ids, gen=0, logprobs=None, step=-1)
        return ids

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float] | None, turn: int) -> None:
        """Append model-produced tokens of assistant turn ``turn`` (logprobs None for teacher text)."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise DataError(f"{len(ids)} generated tokens but {len(logprobs)} logprobs")
        if self.pad_id in ids:
            raise DataError("a model segment contains <|image_pad|>: image pads are never model tokens")
        self._extend(list(ids), gen=1, logprobs=logprobs, step=turn)

    def add_model_text(self, text: str, turn: int) -> list[int]:
        """Append a teacher's assistant text, tokenized with the student's tokenizer, as model tokens."""
        ids = self.tokenize(text)
        self.add_generated(ids, None, turn)
        return ids

    def _extend(self, ids: list[int], gen: int, logprobs: Sequence[float] | None, step: int) -> None:
        self.input_ids.extend(ids)
        self.gen_mask.extend([gen] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.step_ids.extend([step] * len(ids))

    def image_map(self) -> dict[str, np.ndarray]:
        """content hash -> array of every image so far (what ``write_trajectories`` needs)."""
        return {image_hash(a): a for a in self.images}

    def build(self, *, kind: str, **fields: Any) -> Trajectory:
        """The finished record; ``fields`` are the non-token fields of ``Trajectory``."""
        t = Trajectory(
            kind=kind, input_ids=list(self.input_ids), gen_mask=list(self.gen_mask),
            logprobs=list(self.logprobs) if kind == "policy" else [], step_ids=list(self.step_ids),
            images=[image_hash(a) for a in self.images], image_max_pixels=list(self.image_max_pixels),
            processor=dict(self.settings), **fields)
        t.check()
        return t


def question_images(image_dir: Path, row: dict[str, Any]) -> list:
    """The RGB arrays of a synthesized question's images (stored under the synthesize run's images/)."""
    out = []
    for name in row["images"]:
        with Image.open(image_dir / name) as im:
            out.append(np.asarray(im.convert("RGB")))
    return out
