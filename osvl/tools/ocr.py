"""``ocr(image)``: text blocks with boxes and the full text.

Two backends behind one function, chosen with ``ctx.options["ocr_backend"]``:

- ``rapidocr`` (default): RapidOCR 3.x on onnxruntime; its PP-OCR detection,
  orientation and recognition models ship inside the wheel, so it works offline.
- ``tesseract``: Debian's ``tesseract`` binary run as a subprocess (TSV output,
  words grouped into lines). Optional; without the binary it is a
  ``DependencyMissingError`` naming the apt command, which the tool reports as
  ``unavailable``.

``ocr_batch`` takes a list of images so a Serve deployment can ``@serve.batch``
requests. PP-OCR's recogniser already batches the text lines of one image, and
the detector runs per image (inputs differ in size), so a batch saves the
per-request overhead and keeps one engine per replica rather than fusing
forward passes across images.

``char_error_rate`` and ``word_recall`` are the acceptance metrics (tests and the
HTTP checks import them).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from functools import cache
from typing import Any

import numpy as np
from PIL import Image

from osvl.errors import DependencyMissingError
from osvl.tools.base import IMAGE_ARG, InvalidCall, Tool, ToolContext, ToolResult, register

BACKENDS = ("rapidocr", "tesseract")
TESSERACT_INSTALL = "apt-get install -y tesseract-ocr tesseract-ocr-eng"


@cache
def _rapidocr_engine() -> Any:
    try:
        from rapidocr import RapidOCR  # noqa: PLC0415 (a) optional dependency
    except ImportError:
        raise DependencyMissingError("rapidocr", "pip install rapidocr onnxruntime") from None
    return RapidOCR(params={"Global.log_level": "warning"})


def _rapidocr(img: np.ndarray) -> list[dict[str, Any]]:
    out = _rapidocr_engine()(np.ascontiguousarray(img[:, :, ::-1]))  # RapidOCR reads arrays as BGR
    if out.boxes is None:
        return []
    return [{"text": t, "score": round(float(s), 4), "box": np.asarray(b).round(1).tolist()}
            for t, s, b in zip(out.txts, out.scores, out.boxes, strict=True)]


def _tesseract(img: np.ndarray, cmd: str = "tesseract", lang: str = "eng") -> list[dict[str, Any]]:
    """Words from ``tesseract stdin stdout tsv`` grouped into lines (block, paragraph, line)."""
    exe = shutil.which(cmd)
    if exe is None:
        raise DependencyMissingError("tesseract-ocr", TESSERACT_INSTALL, f"no {cmd!r} binary on PATH")
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    proc = subprocess.run([exe, "stdin", "stdout", "-l", lang, "tsv"], input=buf.getvalue(),
                          capture_output=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tesseract failed: {proc.stderr.decode(errors='replace')[-300:]}")
    lines: dict[tuple[str, ...], dict[str, Any]] = {}
    rows = proc.stdout.decode(errors="replace").splitlines()
    for row in rows[1:]:
        f = row.split("\t")
        if len(f) < 12 or f[0] != "5" or not f[11].strip():
            continue  # level 5 = word
        x, y, w, h, conf = int(f[6]), int(f[7]), int(f[8]), int(f[9]), float(f[10])
        ln = lines.setdefault(tuple(f[1:5]), {"words": [], "conf": [], "x0": x, "y0": y, "x1": x + w, "y1": y + h})
        ln["words"].append(f[11])
        ln["conf"].append(conf)
        ln["x0"], ln["y0"] = min(ln["x0"], x), min(ln["y0"], y)
        ln["x1"], ln["y1"] = max(ln["x1"], x + w), max(ln["y1"], y + h)
    blocks = []
    for ln in lines.values():
        x0, y0, x1, y1 = ln["x0"], ln["y0"], ln["x1"], ln["y1"]
        blocks.append({"text": " ".join(ln["words"]), "score": round(float(np.mean(ln["conf"])) / 100.0, 4),
                       "box": [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]})
    return blocks


def ocr_batch(images: list[np.ndarray], backend: str = "rapidocr", **backend_options: Any) -> list[list[dict]]:
    """Text blocks ``{text, score, box}`` (box: four corners tl, tr, br, bl) per image, in reading order."""
    if backend not in BACKENDS:
        raise InvalidCall(f"unknown OCR backend {backend!r}; choose one of {BACKENDS}")
    run = _rapidocr if backend == "rapidocr" else _tesseract
    return [run(img, **backend_options) for img in images]


def full_text(blocks: list[dict[str, Any]]) -> str:
    return "\n".join(b["text"] for b in blocks)


def ocr(ctx: ToolContext, image: Any = None) -> ToolResult:
    img = ctx.image(image)
    backend = ctx.options.get("ocr_backend", "rapidocr")
    try:
        (blocks,) = ocr_batch([img], backend, **ctx.options.get("ocr_backend_options", {}))
    except DependencyMissingError as e:
        return ToolResult.fail("unavailable", f"ocr: {e}")
    data = {"blocks": blocks, "text": full_text(blocks), "backend": backend}
    if not blocks:
        return ToolResult("ok", f"No text found in {image}.", data=data)
    lines = []
    for b in blocks:
        xs, ys = [p[0] for p in b["box"]], [p[1] for p in b["box"]]
        x, y = int(min(xs)), int(min(ys))
        lines.append(f"[x={x}, y={y}, w={int(max(xs)) - x}, h={int(max(ys)) - y}] {b['text']}")
    return ToolResult("ok", f"Found {len(blocks)} text block(s) in {image}:\n" + "\n".join(lines), data=data)


# ---------------------------------------------------------------------------
# acceptance metrics


def char_error_rate(pred: str, truth: str) -> float:
    """Levenshtein distance / len(truth), on whitespace-normalised strings."""
    a, b = " ".join(pred.split()), " ".join(truth.split())
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1] / max(1, len(b))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def word_recall(pred: str, truth: str) -> float:
    """Share of the truth's words (lower-cased, punctuation dropped) that OCR read, counted with multiplicity."""
    have: dict[str, int] = {}
    for w in _words(pred):
        have[w] = have.get(w, 0) + 1
    want = _words(truth)
    hit = 0
    for w in want:
        if have.get(w, 0) > 0:
            have[w] -= 1
            hit += 1
    return hit / max(1, len(want))


register(Tool(
    name="ocr",
    description="Read the text in an image: returns each text line with its bounding box (x, y, w, h) "
                "in that image's pixels, in reading order.",
    parameters={
        "type": "object",
        "properties": {"image": IMAGE_ARG},
        "required": ["image"],
    },
    fn=ocr,
    backend="rapidocr",
    version="1",
))
