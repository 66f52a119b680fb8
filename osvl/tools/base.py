"""What every tool shares: the typed result, image references, argument validation, the registry.

A tool is a pure function ``fn(ctx, **arguments) -> ToolResult``: no Ray, no HTTP.
The same function runs in-process, inside a Serve deployment and behind the HTTP
API, so its behaviour is tested once. Images travel as ``uint8`` RGB arrays of
shape (H, W, 3); arguments name them by reference (``"image": "img_2"``) and
coordinates are in that image's own pixels.

Errors are values, not strings to guess from: a tool that fails returns
``ToolResult.fail(kind, message)`` with one of the four kinds of docs/design.md.
Validation failures (unknown tool, wrong types, out-of-range numbers, an image
reference that does not exist) are ``invalid_call``; inputs over a configured
limit are ``invalid_call`` with ``limit=True`` so the HTTP layer can answer 413.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osvl.errors import TOOL_ERROR_KINDS, ConfigError, InvalidCall

IMAGE_ARG = {"type": "string", "description": "Image reference, e.g. 'img_1'."}
"""JSON schema of an image argument: every image tool names its input image this way."""

MAX_PIXELS = 40_000_000
"""Default cap on the pixels of any image a tool receives or produces (decompression bombs, OOM)."""


@dataclass
class TextHit:
    """One text-search hit; the local index and the web backend both answer lists of these."""

    title: str
    snippet: str
    score: float
    url: str = ""  # web hits
    summary: str = ""  # web hits: the LLM's summary of the page for this query


@dataclass
class ToolError:
    kind: str
    message: str
    limit: bool = False  # an over-limit input: still ``invalid_call``, but HTTP 413

    def __post_init__(self) -> None:
        if self.kind not in TOOL_ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {self.kind!r}")


@dataclass
class ToolResult:
    """``{status, text, images, error}`` of docs/design.md; ``images`` maps new names to arrays."""

    status: str
    text: str = ""
    images: dict[str, np.ndarray] = field(default_factory=dict)
    error: ToolError | None = None
    data: dict[str, Any] = field(default_factory=dict)  # structured extras (OCR boxes, search hits)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def fail(cls, kind: str, message: str, *, limit: bool = False) -> ToolResult:
        return cls(status="error", text=f"Error ({kind}): {message}", error=ToolError(kind, message, limit))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready view without image bytes (transports add images their own way)."""
        return {
            "status": self.status,
            "text": self.text,
            "images": sorted(self.images),
            "error": None if self.error is None else {"kind": self.error.kind, "message": self.error.message},
            "data": self.data,
        }


@dataclass
class ToolContext:
    """What a tool call can see besides its arguments: the episode's images and the new image's name."""

    images: Mapping[str, np.ndarray]
    new_image_name: str = ""
    max_pixels: int = MAX_PIXELS
    options: dict[str, Any] = field(default_factory=dict)  # backend objects (search indexes, models)

    def image(self, ref: Any, arg: str = "image") -> np.ndarray:
        if not isinstance(ref, str):
            raise InvalidCall(f"{arg} must be an image reference like 'img_1', got {type(ref).__name__}")
        if ref not in self.images:
            known = ", ".join(sorted(self.images)) or "none"
            raise InvalidCall(f"{arg}: no image named {ref!r} (available: {known})")
        arr = self.images[ref]
        check_image(arr, self.max_pixels, arg)
        return arr

    def next_name(self) -> str:
        if self.new_image_name:
            return self.new_image_name
        nums = [int(k[4:]) for k in self.images if k.startswith("img_") and k[4:].isdigit()]
        return f"img_{max(nums, default=0) + 1}"


def check_image(arr: Any, max_pixels: int, arg: str = "image") -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise InvalidCall(f"{arg}: expected an RGB uint8 image")
    h, w = arr.shape[:2]
    if h == 0 or w == 0:
        raise InvalidCall(f"{arg}: empty image")
    if h * w > max_pixels:
        raise InvalidCall(f"{arg}: {w}x{h} = {h * w} pixels exceeds the limit of {max_pixels}", limit=True)


def number(args: Mapping[str, Any], name: str, default: float | None = None, *, lo: float = -math.inf,
           hi: float = math.inf, integer: bool = False) -> float:
    """Read a finite number argument in [lo, hi]; bools and strings are rejected, not coerced."""
    if name not in args:
        if default is None:
            raise InvalidCall(f"missing required argument {name!r}")
        return default
    v = args[name]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidCall(f"{name} must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise InvalidCall(f"{name} must be finite, got {v}")
    if integer and not float(v).is_integer():
        raise InvalidCall(f"{name} must be an integer, got {v}")
    if not lo <= v <= hi:
        raise InvalidCall(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v) if integer else float(v)


@dataclass
class Tool:
    """A registered tool: OpenAI-style schema plus the pure function that runs it."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., ToolResult]
    backend: str = "local"
    version: str = "1"

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


REGISTRY: dict[str, Tool] = {}


def register(tool: Tool) -> Tool:
    REGISTRY[tool.name] = tool
    return tool


def call_tool(tool: Tool, arguments: Any, ctx: ToolContext) -> ToolResult:
    """Run one tool call; every failure comes back as a typed ``ToolResult``, never an exception.

    Unknown-argument and type checks happen here so every tool gets them for free.
    A crash inside a tool is a ``tool_error`` (the tool ran and failed), not a 5xx.
    """
    if not isinstance(arguments, dict):
        return ToolResult.fail("invalid_call", f"arguments must be a JSON object, got {type(arguments).__name__}")
    props = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return ToolResult.fail("invalid_call", f"{tool.name}: unknown argument(s) {unknown}; "
                                               f"expected {sorted(props)}")
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return ToolResult.fail("invalid_call", f"{tool.name}: missing required argument(s) {missing}")
    try:
        result = tool.fn(ctx, **arguments)
    except InvalidCall as e:
        return ToolResult.fail("invalid_call", f"{tool.name}: {e}", limit=e.limit)
    except MemoryError:
        return ToolResult.fail("invalid_call", f"{tool.name}: input too large for memory", limit=True)
    except Exception as e:  # noqa: BLE001 - the tool ran and failed; type the failure, keep the message
        return ToolResult.fail("tool_error", f"{tool.name}: {type(e).__name__}: {e}")
    for name, arr in result.images.items():
        try:
            check_image(arr, ctx.max_pixels, name)
        except InvalidCall as e:
            return ToolResult.fail("invalid_call", f"{tool.name} output: {e}", limit=e.limit)
    return result


class LazyBackend:
    """A search backend built from its config on the first search, owned by whoever made it.

    Search indexes take seconds to minutes to build or load, so an environment builds its
    backends this way (``osvl.agent.env.search_backends``) and one whose episodes never search
    never pays for them. ``backend_id`` (a hash of the config) is what the record/replay cache
    keys on, known without building; ``cfg`` is the settings (image_search reads its snippet length).
    There is no module-level instance: two environments with different settings hold two of these.
    """

    def __init__(self, build: Callable[[Any], Any], cfg: Any) -> None:
        self._build, self.cfg, self._obj = build, cfg, None
        self._lock = threading.Lock()
        blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
        self.backend_id = "config:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def get(self) -> Any:
        """The backend, built on the first call (once, whatever the number of threads asking)."""
        with self._lock:
            if self._obj is None:
                self._obj = self._build(self.cfg)
            return self._obj

    def search(self, *args: Any, **kwargs: Any) -> Any:
        return self.get().search(*args, **kwargs)


def option_backend(ctx: ToolContext, name: str) -> Any:
    """The backend a search tool calls: ``ctx.options[name]``, never a default of the tool's own.

    A default would be a second environment, one the policy was not trained in; whoever runs the
    tools builds it from its config (``osvl.agent.env``) and passes it in ``ToolContext.options``.
    """
    backend = ctx.options.get(name)
    if backend is None:
        raise ConfigError(f"{name} has no backend: ToolContext.options[{name!r}] is empty (build the tools' "
                          f"environment with osvl.agent.env, which passes one)")
    return backend
