"""Benchmark files -> eval items, whatever layout they come in.

An item is a dict: ``id``, ``question``, ``answer``, ``answer_aliases`` (other accepted
forms), ``images`` (each an absolute path or the image's bytes), ``line`` (1-based line
or row of the file) and, for synthesized questions, the KG ``path`` the path-oracle needs.

Formats, told apart by the file's suffix and the first row's keys:

- **generic JSONL** (``question`` plus ``answer`` or ``answers``): ``id`` (default
  ``<file stem>-<line>``), ``answer`` a string, or ``answers`` a list whose first entry
  is the answer and the rest aliases (``answer_aliases`` also accepted), ``images`` a list
  of paths relative to the file (``image`` one path). The OpenSearch-VL RL JSONL is this
  layout.
- **ShareGPT** (``conversations``): the first human turn without its ``<image>`` tags is
  the question, the last assistant ``<response>`` the answer, ``images`` relative to the
  file (the first ones, as many as the human turn has tags).
- **BrowseComp-VL** (``image_path``, ``answers``, ``domain``) and **Chinese SimpleVQA**
  (``final_question``, ``final_answer``, ``matched_image``): their images are not shipped,
  so they resolve under ``image_root``; ``recognition_answer`` of SimpleVQA is not scored.
- **Parquet**: a synthesize run's ``sft``/``rl``/``heldout.parquet`` (``path`` column;
  images named under the ``images/`` folder beside it), or the OpenSearch-VL released RL
  Parquet: ``images`` a list of ``{bytes, path}`` structs (or raw bytes), the question in
  ``question`` or the last user message of ``prompt`` (``<image>`` tags dropped), the
  answer in ``answer`` or ``reward_model.ground_truth``.

A row that lacks a field, or whose image is missing or unreadable, is not an item: it is
counted in ``Benchmark.problems`` with its line and reason, and the rest load. A file in
no known layout raises ``DataError``.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from osvl.errors import DataError

IMAGE_TAG = "<image>"
_RESPONSE = re.compile(r"<response>(.*?)</response>", re.S)


@dataclass
class Benchmark:
    """The items of one file, and the rows that could not be items (line, id, kind, detail)."""

    name: str
    path: str
    format: str
    items: list[dict[str, Any]]
    problems: list[dict[str, Any]] = field(default_factory=list)


def load_image(ref: str | bytes) -> np.ndarray:
    """An item image (a path or encoded bytes) as an RGB uint8 array; ``DataError`` when unreadable."""
    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"unreadable image {ref if isinstance(ref, str) else '(bytes)'}: {e}") from None


def _check_images(images: list[str | bytes]) -> str:
    """'' when every image opens, else why not (missing / unreadable)."""
    for ref in images:
        if isinstance(ref, str) and not Path(ref).is_file():
            return f"missing_image: {ref}"
        try:
            with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
                im.verify()
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a broken file
            # embedded bytes: no message (PIL's names a BytesIO by memory address, which differs per run)
            return (f"unreadable_image: {type(e).__name__}: {e}" if isinstance(ref, str)
                    else f"unreadable_image: {type(e).__name__} (embedded image bytes)")[:300]
    return ""


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return list(enumerate(json.loads(text), start=1))
    out = []
    for k, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((k, json.loads(line)))
            except ValueError as e:
                out.append((k, DataError(f"not JSON: {e}")))
    return out


def _generic(row: dict, base: Path, stem: str, line: int) -> dict[str, Any]:
    answers = row.get("answers")
    if "answer" in row:
        answer, aliases = str(row["answer"]), [str(a) for a in row.get("answer_aliases") or []]
    elif isinstance(answers, list) and answers:
        answer, aliases = str(answers[0]), [str(a) for a in answers[1:]]
    else:
        raise KeyError("answer")
    images = row.get("images")
    if images is None:
        images = [row["image"]] if row.get("image") else []
    return {"id": str(row.get("id") or f"{stem}-{line}"), "question": str(row["question"]), "answer": answer,
            "answer_aliases": aliases, "images": [str((base / p).resolve()) for p in images]}


def _sharegpt(row: dict, base: Path, stem: str, line: int) -> dict[str, Any]:
    conv = row["conversations"]
    first = conv[0]["value"]
    responses = [m for c in conv if c.get("from") == "gpt" for m in _RESPONSE.findall(c.get("value", ""))]
    if not responses:
        raise KeyError("answer (no <response> in the gpt turns)")
    n = first.count(IMAGE_TAG)
    return {"id": str(row.get("id") or f"{stem}-{line}"), "question": re.sub(re.escape(IMAGE_TAG) + r"\n?", "",
                                                                             first).strip(),
            "answer": responses[-1].strip(), "answer_aliases": [],
            "images": [str((base / p).resolve()) for p in (row.get("images") or [])[:n]]}


def _browsecomp_vl(row: dict, root: Path, stem: str, line: int) -> dict[str, Any]:
    answers = [str(a) for a in row["answers"]]
    return {"id": f"{stem}-{line}", "question": str(row["question"]), "answer": answers[0],
            "answer_aliases": answers[1:], "images": [str(root / row["image_path"])]}


def _simplevqa(row: dict, root: Path, stem: str, line: int) -> dict[str, Any]:
    return {"id": str(row.get("ID") or f"{stem}-{line}"), "question": str(row["final_question"]),
            "answer": str(row["final_answer"]), "answer_aliases": [],
            "images": [str(root / row["matched_image"])]}


JSON_FORMATS = (  # (name, keys that identify it, row reader); the first whose keys the first row has wins
    ("sharegpt", {"conversations"}, _sharegpt),
    ("simplevqa", {"final_question", "final_answer"}, _simplevqa),
    ("browsecomp_vl", {"image_path", "answers", "domain"}, _browsecomp_vl),
    ("generic", {"question"}, _generic),
)


def _released_rl(row: dict) -> tuple[str, str, list[bytes]]:
    """(question, answer, image bytes) of one OpenSearch-VL released RL Parquet row."""
    question = row.get("question")
    if question is None:
        users = [m for m in row["prompt"] if m.get("role") == "user"]
        question = users[-1]["content"]
    answer = row.get("answer")
    if answer is None:
        answer = row["reward_model"]["ground_truth"]
    images = [im["bytes"] if isinstance(im, dict) else im for im in row.get("images") or []]
    return re.sub(re.escape(IMAGE_TAG) + r"\n?", "", str(question)).strip(), str(answer), list(images)


def _parquet(path: Path) -> tuple[str, list[tuple[int, dict[str, Any] | Exception]]]:
    rows = pq.read_table(path).to_pylist()
    if not rows:
        return "parquet", []
    out: list[tuple[int, dict[str, Any] | Exception]] = []
    synth = "path" in rows[0] and all(isinstance(x, str) for x in rows[0].get("images") or [])
    for k, row in enumerate(rows, start=1):
        try:
            if synth:
                item = {k2: row[k2] for k2 in ("id", "question", "answer", "path", "degraded", "degradation",
                                               "answer_key") if k2 in row}
                item["answer_aliases"] = list(row.get("answer_aliases") or [])
                item["images"] = [str((path.parent / "images" / n).resolve()) for n in row["images"]]
            else:
                q, a, imgs = _released_rl(row)
                extra = row.get("extra_info") or {}
                rid = row.get("id") or (extra.get("index") if isinstance(extra, dict) else None)
                item = {"id": str(rid if rid is not None else f"{path.stem}-{k}"), "question": q, "answer": a,
                        "answer_aliases": [], "images": imgs}
            out.append((k, item))
        except (KeyError, TypeError, IndexError) as e:
            out.append((k, e))
    return ("synthesized" if synth else "opensearch_vl_rl"), out


def load_benchmark(path: str | Path, image_root: str | Path = "", name: str = "") -> Benchmark:
    """The items of ``path`` (see the module doc); ``image_root`` resolves BrowseComp-VL/SimpleVQA images."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"benchmark file not found: {path}")
    name = name or path.stem
    if path.suffix == ".parquet":
        kind, parsed = _parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        records = _read_jsonl(path)
        first = next((r for _, r in records if isinstance(r, dict)), None)
        match = [f for f in JSON_FORMATS if first is not None and f[1] <= set(first)]
        if not match:
            raise DataError(f"{path}: unknown benchmark layout (first row keys {sorted(first or {})}); expected "
                            f"one of: {', '.join(f'{n} {sorted(keys)}' for n, keys, _ in JSON_FORMATS)}")
        kind, _, reader = match[0]
        needs_root = kind in ("browsecomp_vl", "simplevqa")
        base = Path(image_root) if (needs_root and image_root) else path.parent
        parsed = []
        for k, r in records:
            if isinstance(r, Exception):
                parsed.append((k, r))
                continue
            try:
                parsed.append((k, reader(r, base, path.stem, k)))
            except (KeyError, TypeError, IndexError, AttributeError) as e:
                parsed.append((k, e))
    else:
        raise DataError(f"{path}: unknown benchmark file type {path.suffix!r}; expected .jsonl, .json or .parquet")
    bench = Benchmark(name=name, path=str(path), format=kind, items=[])
    seen: set[str] = set()
    for line, item in parsed:
        if isinstance(item, Exception):
            why = f"missing_field: {item}" if isinstance(item, KeyError) else f"bad_row: {item}"
            bench.problems.append({"line": line, "id": "", "kind": why.split(":")[0], "detail": why})
            continue
        problem = _check_images(item["images"])
        if not problem and item["id"] in seen:
            problem = f"duplicate_id: {item['id']}"
        if problem:
            bench.problems.append({"line": line, "id": item["id"], "kind": problem.split(":")[0], "detail": problem})
            continue
        seen.add(item["id"])
        bench.items.append({**item, "line": line})
    return bench
