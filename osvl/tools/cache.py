"""Record/replay cache for every tool call, and the on-disk home of search indexes.

Why a cache around ``call_tool`` rather than inside each tool: determinism is a
property of a *run* (an eval that must score the same twice, an RL run that must be
replayable), not of a tool, and web search answers change by the hour. Wrapping the
one entry point every caller already uses (``call_tool``) gives every tool the same
four modes:

- ``off``: call the tool, read and write nothing.
- ``record``: always call the tool and (over)write the recording.
- ``replay``: answer from the recording; on a miss call the tool and record it, so the
  first run records and every later run is deterministic.
- ``strict-replay``: answer only from the recording; a miss is an ``unavailable`` error
  and the tool is never called (evals that must not touch the network).

The key is a SHA-256 of the tool name, its version and backend, the backend object's
``backend_id`` when ``ctx.options`` carries one under the tool's name (an environment's search
backend: a hash of the config it is built from, ``osvl.agent.env``; or an index content hash, a
search API name), and the canonical JSON of the arguments in which every image
reference is replaced by the SHA-256 of that image's pixels. Image *names* are not in the
key: ``crop(img_1, ...)`` in one episode and ``crop(img_3, ...)`` on the same pixels in
another are the same call. Names that do appear in the result text ("Cropped img_1 ... as
img_2.") are stored as placeholders and filled back with the caller's names on replay.

Errors of kind ``timeout`` and ``unavailable`` are transient and never recorded; the
others (``invalid_call``, ``tool_error``) are deterministic answers and are.

Storage: one file per key (``<root>/<key[:2]>/<key>.npz``), written to a temporary file in
the same folder and moved into place with ``os.replace``, which is atomic on POSIX: any
number of processes (rollout actors, Serve replicas) may record at once, a reader sees
either the whole old file or the whole new one, and two writers of one key write the
same bytes anyway. No lock, no index file to corrupt.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from osvl.config import DEFAULT_RUN_ROOT
from osvl.errors import ConfigError
from osvl.storage import atomic_write
from osvl.tools.base import ToolContext, ToolError, ToolResult, call_tool

CacheMode = Literal["off", "record", "replay", "strict-replay"]
MODES = get_args(CacheMode)
_RECORDED_ERRORS = ("invalid_call", "tool_error")
_IMAGE_NAME = re.compile(r"\bimg_\d+\b")


def store_root() -> Path:
    """Where osvl keeps derived files (search indexes, recordings): ``$OSVL_CACHE`` or ``<run root>/cache``."""
    return Path(os.environ.get("OSVL_CACHE") or Path(DEFAULT_RUN_ROOT) / "cache")


def file_digest(paths: list[Path], extra: str = "") -> str:
    """16-hex content hash of files (and a config string): the name of an index built from them."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def image_digest(arr: np.ndarray) -> str:
    """SHA-256 of an image's shape and pixels (what the recipe calls the image content hash)."""
    h = hashlib.sha256(f"{arr.shape}|{arr.dtype}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


class ToolCache:
    """``cache.call(tool, arguments, ctx)`` is ``call_tool`` with record/replay; see the module doc."""

    def __init__(self, root: str | Path | None = None, mode: str = "replay") -> None:
        if mode not in MODES:
            raise ConfigError(f"tool cache mode must be one of {MODES}, got {mode!r}")
        self.root = Path(root) if root is not None else store_root() / "tool_calls"
        self.mode = mode
        self.hits = 0
        self.misses = 0

    def key(self, tool: Any, arguments: Any, ctx: ToolContext) -> tuple[str, dict[str, str]]:
        """The recording key, and the image names of this call mapped to their placeholders."""
        names: dict[str, str] = {}
        canon = _canonical(arguments, ctx, names)
        blob = json.dumps({
            "tool": tool.name, "version": tool.version, "backend": tool.backend,
            "backend_id": _backend_id(tool, ctx), "arguments": canon,
        }, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest(), names

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.npz"

    def call(self, tool: Any, arguments: Any, ctx: ToolContext) -> ToolResult:
        if self.mode == "off":
            return call_tool(tool, arguments, ctx)
        key, names = self.key(tool, arguments, ctx)
        path = self.path(key)
        if self.mode in ("replay", "strict-replay") and path.is_file():
            self.hits += 1
            return _load(path, names, ctx)
        if self.mode == "strict-replay":
            self.misses += 1
            return ToolResult.fail("unavailable", f"{tool.name}: no recording for this call in strict-replay "
                                                  f"mode (key {key[:12]})")
        self.misses += 1
        result = call_tool(tool, arguments, ctx)
        if result.ok or (result.error is not None and result.error.kind in _RECORDED_ERRORS):
            atomic_write(path, _dump(result, names, ctx))
        return result


def _backend_id(tool: Any, ctx: ToolContext) -> str:
    """Which backend answers: the one in ``ctx.options[tool.name]`` (tools without a backend: none)."""
    backend = ctx.options.get(tool.name)
    if backend is not None:
        return "options:" + str(getattr(backend, "backend_id", type(backend).__name__))
    return ""


def _canonical(value: Any, ctx: ToolContext, names: dict[str, str]) -> Any:
    """Arguments with image references replaced by content hashes; ``names`` collects ref -> placeholder."""
    if isinstance(value, str) and value in ctx.images:
        arr = ctx.images[value]
        if isinstance(arr, np.ndarray):
            names.setdefault(value, f"\x00arg{len(names)}\x00")
            return {"image_sha256": image_digest(arr)}
    if isinstance(value, dict):
        return {str(k): _canonical(v, ctx, names) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_canonical(v, ctx, names) for v in value]
    return value


def _template(text: str, names: dict[str, str], new: list[str]) -> str:
    """Replace this call's image names in ``text`` by placeholders (argument names and new names)."""
    def sub(m: re.Match) -> str:
        name = m.group(0)
        if name in names:
            return names[name]
        if name in new:
            return f"\x00new{new.index(name)}\x00"
        return name
    return _IMAGE_NAME.sub(sub, text)


def _fill(text: str, names: dict[str, str], new: list[str]) -> str:
    for name, ph in names.items():
        text = text.replace(ph, name)
    for i, name in enumerate(new):
        text = text.replace(f"\x00new{i}\x00", name)
    return text


def _new_names(ctx: ToolContext, count: int) -> list[str]:
    """Names the caller's context gives to ``count`` new images (the first is ``ctx.next_name()``)."""
    first = ctx.next_name()
    if count <= 1 or not first.startswith("img_") or not first[4:].isdigit():
        return [first] if count else []
    start = int(first[4:])
    return [f"img_{start + i}" for i in range(count)]


def _dump(result: ToolResult, names: dict[str, str], ctx: ToolContext) -> bytes:
    new = list(result.images)
    meta = {
        "status": result.status,
        "text": _template(result.text, names, new),
        "error": None if result.error is None else {"kind": result.error.kind, "limit": result.error.limit,
                                                    "message": _template(result.error.message, names, new)},
        "data": _template(json.dumps(result.data, ensure_ascii=False), names, new),
        "images": len(new),
    }
    arrays = {f"image_{i}": result.images[n] for i, n in enumerate(new)}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def _load(path: Path, names: dict[str, str], ctx: ToolContext) -> ToolResult:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        images = [z[f"image_{i}"] for i in range(meta["images"])]
    new = _new_names(ctx, len(images))
    err = meta["error"]
    return ToolResult(
        status=meta["status"],
        text=_fill(meta["text"], names, new),
        images=dict(zip(new, images, strict=True)),
        error=None if err is None else ToolError(err["kind"], _fill(err["message"], names, new), err["limit"]),
        data=json.loads(_fill(meta["data"], names, new)),
    )
