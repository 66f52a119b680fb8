"""The tool API as a Ray Serve application: one deployment per tool plus an HTTP ingress.

Layout::

    HTTP ──► api (FastAPI ingress: auth, body/pixel limits, image codec, status codes;
                 │  runs the ``inline`` tools -- crop, sharpen, perspective_correct -- itself)
                 │ DeploymentHandle (every other tool)
                 ▼
             tool_crop, tool_sharpen, ..., tool_super_resolution (@serve.batch), tool_ocr (@serve.batch)
                 ▲
    rollout actors call tool_* directly through handles (osvl.tools.client, transport "handle")

Why one deployment per tool: tools differ by orders of magnitude in cost (crop is
microseconds, EDSR is a network), so each scales on its own (autoscaling on
ongoing requests) and only EDSR asks for a GPU. Tool replicas take and return
``ToolResult`` objects with numpy arrays, so handle callers skip HTTP and
base64 entirely; only the ingress converts to and from the wire format.
Why some tools run in the ingress for HTTP calls (``ServeConfig.inline``): a
stateless image tool costs a few milliseconds, about what the second hop
(ingress -> tool replica, arrays pickled both ways) costs, so forwarding it made
osvl's HTTP slower than a one-deployment app; such calls now take the same hops
as that app (proxy -> one replica). Model-backed and batched tools (EDSR, OCR)
and the search tools (their indexes live in their replicas) are forwarded.

Wire formats: a call is either base64 JSON (``{"arguments", "images", "new_image_name"}``,
what curl users write) or ``multipart/form-data`` (an ``arguments`` JSON part and one
PNG/JPEG/WebP part per image, what ``osvl.tools.client`` sends by default; an image part is read
from its bytes whatever Content-Type it declares, so the schema's binary parts are exactly what is
accepted); a client that
accepts ``multipart/form-data`` gets new images back as PNG parts, otherwise as base64
JSON. Each image is decoded once (here) and encoded once (here): replicas get and return
arrays. ``GET /openapi.json`` describes every tool's own request body (``POST
/v1/tools/<tool>``, its ``arguments`` schema the tool's JSON schema, with a working
example) beside the generic ``POST /v1/tools/{name}``, so generated clients and fuzzers
make real calls.

Why the ingress decodes images itself: limits must hold before any work is done.
The body is read in chunks up to ``max_body_bytes`` (413 past it), and each image
header is checked against ``max_pixels`` before its pixels are decoded (413).
Statuses: 200 for ``ok`` and ``tool_error`` results (the call was valid, the
tool answered), 422 ``invalid_call``, 413 over a limit, 415 for a body that is
neither JSON nor multipart, 401 without the bearer
token when auth is on, 504 ``timeout``, 503 ``unavailable``. The body of every
non-2xx answer is still a typed tool result.

Handle callers (``osvl.tools.client.HandleTransport``) send images as ObjectRefs and
group concurrent calls to one tool into one ``call_many`` request; each call is
still run and metered on its own (``osvl.metrics``: requests by tool and status,
latency, in flight, batch size).

Start it: ``python -m serve.app --config=serve/config.yaml`` (a loopback Ray cluster
and the app, for a laptop), or ``serve run serve/config.yaml`` / ``serve deploy`` on
a cluster; the builder ``build_app(args)`` takes the ``ServeConfig`` fields as ``args``.
serve/README.md shows every command.
"""

# no `from __future__ import annotations`: FastAPI must see the real ``Request`` type on the replica
import asyncio
import base64
import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import ray
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.config import HTTPOptions
from ray.serve.context import _get_global_client

from osvl import metrics
from osvl.agent.env import search_backends
from osvl.cluster import init_ray, role_resources, start_serve
from osvl.config import apply_override, dump, format_help, from_dict, load_yaml, merge, normalize_args, opt
from osvl.errors import ConfigError
from osvl.logs import setup
from osvl.metrics import Recorder
from osvl.tools.base import MAX_PIXELS, InvalidCall, Tool, ToolContext, ToolResult, call_tool
from osvl.tools.client import (
    DEPLOYMENT_PREFIX,
    HTTP_STATUS,
    MULTIPART,
    PART_NAME,
    content_type,
    decode_image,
    decode_multipart,
    image_from_bytes,
    png_bytes,
    ray_failure,
    result_to_multipart,
    result_to_wire,
)
from osvl.tools.image_search import ImageSearchConfig
from osvl.tools.registry import all_tools
from osvl.tools.super_resolution import DEFAULT_WEIGHTS, load_model
from osvl.tools.text_search import TextSearchConfig

APP_NAME = "osvl_tools"


@dataclasses.dataclass
class BackendOptions:
    """The image tools' backends, handed to every tool in ``ToolContext.options`` (beside the search backends)."""

    ocr_backend: Literal["rapidocr", "tesseract"] = opt(
        "rapidocr", "OCR engine (osvl/tools/ocr.py): rapidocr (ONNX, installed) or tesseract (the Debian binary).")
    edsr_weights: str = opt("", "EDSR x4 checkpoint super_resolution loads; empty = the committed weights "
                                "(osvl/tools/weights/edsr_x4.pth).")

    def as_options(self) -> dict[str, Any]:
        return {"ocr_backend": self.ocr_backend, **({"edsr_weights": self.edsr_weights} if self.edsr_weights else {})}


@dataclasses.dataclass
class ServeConfig:
    """Arguments of ``build_app`` (the ``args:`` block of serve/config.yaml)."""

    tools: list[str] = opt([], "Tools to deploy; empty = every tool in osvl.tools.registry.")
    batched: list[str] = opt(["super_resolution", "ocr"], "Tools whose replicas batch requests (@serve.batch).")
    inline: list[str] = opt(["crop", "sharpen", "perspective_correct"],
                            "Tools whose HTTP calls the ingress runs itself (handle callers still reach their "
                            "deployment): stateless image tools cheaper than the hop to a tool replica. "
                            "Never a batched tool.")
    max_batch_size: int = opt(8, "Largest batch a batched tool replica runs at once.")
    batch_wait_timeout_s: float = opt(0.01, "How long a batched replica waits to fill a batch.")
    max_body_bytes: int = opt(32 * 2**20, "Largest HTTP request body, in bytes (413 above).")
    max_pixels: int = opt(MAX_PIXELS, "Largest image (input or output) in pixels (413 above).")
    timeout_s: float = opt(60.0, "Per-call deadline at the ingress, in seconds (504 after).")
    options: BackendOptions = opt(BackendOptions, "What the image tools read from ToolContext.options.")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings: the search engine of the agents that call this app (rollouts and "
        "the agent service with tools=handle: set the GRPO job's rollout.text_search here).")
    image_search: ImageSearchConfig = opt(ImageSearchConfig, "image_search's settings.")
    token_env: str = opt("OSVL_TOOLS_TOKEN", "Environment variable holding the bearer token; "
                         "when it is set where the app is built, every /v1 call must carry it.")
    role_units: float = opt(0.0, "Units of the cluster's tools resource (osvl.cluster.ROLE_RESOURCES) each "
                            "replica of the app requests, added to its ray_actor_options, so that replicas run "
                            "only on nodes that declare it; 0 = none: a laptop's local cluster declares no role "
                            "resources. A Serve config file's ray_actor_options replace the code's: name the "
                            "resource there too.")


REF_CACHE_BYTES = 64 * 2**20
"""Bytes of handle callers' images a tool replica keeps resolved (``_ToolReplica._resolve``)."""


@functools.cache  # a process-wide setting: the ingress and each inline tool in it ask once between them
def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Make glibc's allocator keep freed image buffers in the process instead of unmapping them.

    Why: an image tool allocates a few float copies of its image per call (sharpen on 512x512:
    about 8 MB). glibc serves such blocks with ``mmap`` and returns them to the kernel on free, so
    the next call faults every page in again, zeroed by the kernel: in a tool replica running
    several calls in threads that was most of the cost of a cheap tool (docs/measurements.md has
    the figures). Fixed thresholds keep freed blocks in the heap for reuse (blocks over 32 MB, the
    most glibc allows as a fixed threshold, are still mapped); a replica then holds its peak working
    set, which is what a server wants. Returns whether glibc took the settings (False off glibc,
    e.g. macOS, where nothing changes).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, mmap_threshold)) and bool(mallopt(m_trim_threshold, trim_threshold))


class _ToolReplica:
    """What every tool replica does around one call: context, thread, metrics."""

    def __init__(self, tool: Tool, cfg: dict[str, Any]) -> None:
        keep_freed_memory()
        self.tool = tool
        self.cfg = from_dict(ServeConfig, cfg)
        # the search backends of this app's settings, each built on its replica's first search (osvl.agent.env)
        self.options: dict[str, Any] = {**search_backends(self.cfg.text_search, self.cfg.image_search),
                                        **self.cfg.options.as_options()}
        self.in_flight = 0
        try:
            ctx = serve.get_replica_context()
            self.replica, app = ctx.replica_id.unique_id, ctx.app_name
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit use)
            self.replica, app = "local", "local"

        self.rec = Recorder("serve", app)  # the tool API serves many runs: its run label is the Serve app
        self._lock = threading.Lock()
        self._arrays: OrderedDict[bytes, Any] = OrderedDict()  # ObjectRef id -> its array, most recent last
        self._array_bytes = 0

    async def _resolve(self, images: Any) -> Any:
        """Handle callers send images as ObjectRefs; HTTP callers (and unit use) send arrays.

        Why a cache: an episode sends the same ``img_1`` ref with every call, and awaiting a borrowed
        ref asks its owner (the caller's process) where the object is, every time, which costs more
        than a cheap tool (serve/README.md has the figures). A ref names one immutable value for its
        whole life, so a hit is never stale. The cached arrays are zero-copy views of
        the object store: up to ``REF_CACHE_BYTES`` per replica stay pinned there.
        """
        if not isinstance(images, dict) or not any(isinstance(v, ray.ObjectRef) for v in images.values()):
            return images
        out = {}
        for name, value in images.items():
            if not isinstance(value, ray.ObjectRef):
                out[name] = value
                continue
            key = value.binary()
            if key in self._arrays:
                self._arrays.move_to_end(key)
                out[name] = self._arrays[key]
                continue
            out[name] = arr = await value
            size = getattr(arr, "nbytes", 0)
            if key not in self._arrays and size <= REF_CACHE_BYTES:  # another call may have fetched it meanwhile
                self._arrays[key] = arr
                self._array_bytes += size
                while self._array_bytes > REF_CACHE_BYTES:
                    self._array_bytes -= getattr(self._arrays.popitem(last=False)[1], "nbytes", 0)
        return out

    async def call_many(self, calls: list[tuple[Any, Any, str]]) -> list[ToolResult]:
        """Several calls in one Serve request (``HandleTransport`` groups concurrent calls); each runs
        and is metered as if it came alone. Serve counts the group as one ongoing request."""
        if not isinstance(calls, list) or not all(isinstance(c, tuple | list) and len(c) == 3 for c in calls):
            return [ToolResult.fail("invalid_call", "call_many takes a list of (arguments, images, name)")]
        return list(await asyncio.gather(*[self(*c) for c in calls]))

    def _in_flight(self, delta: int) -> None:
        with self._lock:
            self.in_flight += delta
            self.rec.set(metrics.TOOL_IN_FLIGHT, self.in_flight, tool=self.tool.name, replica=self.replica)

    def _run(self, arguments: Any, images: Any, new_image_name: str, options: dict[str, Any] | None = None
             ) -> ToolResult:
        start = time.perf_counter()
        self._in_flight(1)
        try:
            if not isinstance(images, dict) or not isinstance(new_image_name, str):
                result = ToolResult.fail("invalid_call", "images must map names to arrays, new_image_name a str")
            else:
                ctx = ToolContext(images, new_image_name, self.cfg.max_pixels, options or self.options)
                result = call_tool(self.tool, arguments, ctx)
        finally:
            self._in_flight(-1)
        status = "ok" if result.ok else result.error.kind
        self.rec.inc(metrics.TOOL_REQUESTS, 1, tool=self.tool.name, status=status)
        self.rec.observe(metrics.TOOL_LATENCY, time.perf_counter() - start, tool=self.tool.name)
        return result


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=8,
                  autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4})
class ToolDeployment(_ToolReplica):
    """One tool, one call per request; the work runs in a thread so the replica keeps accepting requests."""

    async def __call__(self, arguments: Any, images: Any, new_image_name: str = "") -> ToolResult:
        return await asyncio.to_thread(self._run, arguments, await self._resolve(images), new_image_name)


def _load_edsr(options: dict[str, Any]) -> Any:
    return load_model(options.get("edsr_weights", DEFAULT_WEIGHTS))


BATCH_MODELS = {"super_resolution": ("edsr", _load_edsr)}
"""Tools whose batches share one forward pass: tool -> (the ``ctx.options`` key the tool reads its
model from, a loader). Other batched tools (OCR: rapidocr has no batch API) run a batch's calls in
parallel threads, which still caps the replica's concurrency at one batch."""


class _Coalescer:
    """Stands in for a torch model during one batch and merges the batch's forward passes into one.

    Each request of a ``@serve.batch`` batch runs the unchanged tool function in its own thread
    (validation, naming and error typing stay the tool's); the tool calls ``model(x)`` with a
    ``(1, C, H, W)`` tensor. The coalescer holds those calls until every request of the batch has
    either called the model or finished without it, then concatenates inputs of equal shape and runs
    the real model once per shape. Why not a batch function per tool: the tool's own code path is
    the one tested, and any torch-model tool gets batching by naming its option key.
    """

    def __init__(self, model: Any, parties: int) -> None:
        self._model = model
        self._parties = parties  # request threads that have neither called the model nor left
        self._waiting: list[list[Any]] = []  # [input, output or exception or None]
        self._cv = threading.Condition()
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:  # upscale, meta, ...: the model's own attributes
        return getattr(self._model, name)

    def __call__(self, x: Any) -> Any:
        self._local.called = True
        slot = [x, None]
        with self._cv:
            self._waiting.append(slot)
            self._parties -= 1
            self._flush_if_ready()
            while slot[1] is None:
                self._cv.wait()
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return slot[1]

    def leave(self) -> None:
        """Called by each request thread when its tool call returns."""
        if getattr(self._local, "called", False):
            return
        with self._cv:
            self._parties -= 1
            self._flush_if_ready()

    def _flush_if_ready(self) -> None:  # holds self._cv
        if self._parties > 0 or not self._waiting:
            return
        import torch  # noqa: PLC0415 (d) keeps torch out of serve/agent_app.py --help

        groups: dict[tuple, list[list[Any]]] = {}
        for slot in self._waiting:
            groups.setdefault((tuple(slot[0].shape[1:]), slot[0].dtype), []).append(slot)
        for slots in groups.values():
            try:
                with torch.inference_mode():
                    out = self._model(torch.cat([s[0] for s in slots]))
                sizes = [s[0].shape[0] for s in slots]
                for s, y in zip(slots, torch.split(out, sizes), strict=True):
                    s[1] = y
            except Exception as e:  # noqa: BLE001 - every caller of the failed forward gets the error
                for s in slots:
                    s[1] = e
        self._waiting = []
        self._cv.notify_all()


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=32,
                  autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 16})
class BatchedToolDeployment(_ToolReplica):
    """A model-backed tool (EDSR, OCR): concurrent requests are grouped by ``@serve.batch``.

    For tools in ``BATCH_MODELS`` the replica loads the model once and each batch runs one forward
    pass per input size (``_Coalescer``); a model that cannot load (weights missing) is left to the
    tool, which answers each call ``unavailable`` with the reason.
    """

    def __init__(self, tool: Tool, cfg: dict[str, Any]) -> None:
        super().__init__(tool, cfg)

        self._batch.set_max_batch_size(self.cfg.max_batch_size)
        self._batch.set_batch_wait_timeout_s(self.cfg.batch_wait_timeout_s)
        # one thread per request of a batch: the coalescer waits for all of them, so fewer would deadlock
        self._pool = ThreadPoolExecutor(max_workers=self.cfg.max_batch_size)
        self._model_key, self._model = "", None
        if tool.name in BATCH_MODELS:
            key, loader = BATCH_MODELS[tool.name]
            try:
                self._model_key, self._model = key, loader(self.options)
            except Exception:  # noqa: BLE001 - the tool itself reports why, per call
                self._model = None

    async def __call__(self, arguments: Any, images: Any, new_image_name: str = "") -> ToolResult:
        return await self._batch((arguments, await self._resolve(images), new_image_name))

    def _run_one(self, request: tuple[Any, Any, str], coalescer: _Coalescer | None) -> ToolResult:
        if coalescer is None:
            return self._run(*request)
        try:
            return self._run(*request, options={**self.options, self._model_key: coalescer})
        finally:
            coalescer.leave()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _batch(self, requests: list[tuple[Any, Any, str]]) -> list[ToolResult]:
        self.rec.observe(metrics.TOOL_BATCH_SIZE, len(requests), tool=self.tool.name)
        coalescer = None if self._model is None else _Coalescer(self._model, len(requests))
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*[loop.run_in_executor(self._pool, self._run_one, r, coalescer)
                                           for r in requests]))


# ---------------------------------------------------------------------------
# ingress

IMAGES_SCHEMA = {"type": "object", "additionalProperties": {"type": "string", "format": "byte"},
                 "description": "Images by name (img_1, ...), base64 PNG/JPEG/WebP."}
RESULT_SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["ok", "error"]},
        "text": {"type": "string", "description": "What the agent sees inside <tool_response>."},
        "images": {"type": "object", "additionalProperties": {"type": "string", "format": "byte"}},
        "error": {"type": ["object", "null"], "properties": {
            "kind": {"type": "string", "enum": list(HTTP_STATUS)}, "message": {"type": "string"},
            "limit": {"type": "boolean"}}},
        "data": {"type": "object"},
    },
    "required": ["status", "text", "error"],
}
MULTIPART_RESULT_SCHEMA = {
    "type": "object", "required": ["result"],
    "properties": {"result": {**RESULT_SCHEMA, "properties": {**RESULT_SCHEMA["properties"], "images": {
        "type": "array", "items": {"type": "string"}, "description": "Names of the image parts that follow."}}}},
    "additionalProperties": {"type": "string", "format": "binary", "description": "A new image, PNG."},
}
EXAMPLE_ARGUMENTS = {
    "crop": {"image": "img_1", "x": 4, "y": 4, "width": 16, "height": 8},
    "sharpen": {"image": "img_1", "amount": 1.5, "sigma": 2.0},
    "super_resolution": {"image": "img_1"},
    "perspective_correct": {"image": "img_1"},
    "ocr": {"image": "img_1"},
    "text_search": {"query": "lattice tower on the Champ de Mars", "top_k": 3},
    "image_search": {"image": "img_1", "top_k": 3},
}
"""A valid call of each tool, the example of its OpenAPI operation (fuzzers start from it)."""


def _example_image() -> str:
    """A 32x32 gradient as base64 PNG: the image of every example call."""
    ramp = np.linspace(0, 255, 32)
    img = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) / 2 + 128, np.full((32, 32), 90.0)],
                   axis=-1).astype(np.uint8)
    return base64.b64encode(png_bytes(img)).decode("ascii")


def _operation(summary: str, arguments: dict[str, Any], example: dict[str, Any] | None,
               parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One POST operation: the JSON and the multipart request body for ``arguments`` (a JSON schema)."""
    json_body = {"type": "object", "required": ["arguments"], "additionalProperties": False, "properties": {
        "arguments": arguments, "images": IMAGES_SCHEMA,
        "new_image_name": {"type": "string", "description": "Name for a new image (default: next img_k)."}}}
    multipart_body = {"type": "object", "required": ["arguments"], "properties": {
        "arguments": arguments, "new_image_name": {"type": "string"}},
        # image parts: any other part name the server takes (PART_NAME), stated as a pattern so that the schema
        # admits exactly what the server accepts
        "patternProperties": {r"^(?!arguments$|new_image_name$)" + PART_NAME.pattern.removeprefix("^"): {
            "type": "string", "format": "binary",
            "description": "One part per image, named img_1, ...: PNG, JPEG or WebP bytes (read from the bytes, "
                           "whatever Content-Type the part declares)."}},
        "additionalProperties": False}
    json_content: dict[str, Any] = {"schema": json_body}
    if example is not None:
        json_content["example"] = example
    answer = {"application/json": {"schema": RESULT_SCHEMA}}
    responses = {str(code): {"description": why, "content": answer}
                 for code, why in [(401, "missing or wrong bearer token"), (413, "body or image over a limit"),
                                   (415, "body neither JSON nor multipart/form-data"), (422, "invalid_call"),
                                   (503, "unavailable"), (504, "timeout")]}
    responses["200"] = {"description": "ok or tool_error; new images as PNG parts when the client accepts "
                                       "multipart/form-data, else base64 JSON",
                        "content": {**answer, MULTIPART: {"schema": MULTIPART_RESULT_SCHEMA}}}
    op = {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": json_content,
        MULTIPART: {"schema": multipart_body, "encoding": {"arguments": {"contentType": "application/json"}}}}},
          "responses": responses}
    if parameters:
        op["parameters"] = parameters
    return op


def openapi_document(tool_schemas: list[dict[str, Any]], root_path: str = "") -> dict[str, Any]:
    """The API's OpenAPI 3.1 document: a path per tool whose ``arguments`` schema is the tool's own.

    Written out rather than generated by FastAPI because FastAPI sees one route, ``/v1/tools/{name}``,
    whose body it cannot type; a fuzzer given that generic body sends arguments no tool accepts.
    """
    image = _example_image()
    names = [t["function"]["name"] for t in tool_schemas]
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "Liveness (no token needed)", "responses": {"200": {
            "description": "up", "content": {"application/json": {"schema": {"type": "object", "properties": {
                "status": {"type": "string"}, "tools": {"type": "array", "items": {"type": "string"}}}}}}}}}},
        "/v1/tools": {"get": {"summary": "The tools' JSON schemas", "responses": {
            "200": {"description": "the tools", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"tools": {"type": "array", "items": {"type": "object"}}}}}}},
            "401": {"description": "missing or wrong bearer token",
                    "content": {"application/json": {"schema": RESULT_SCHEMA}}}}}},
    }
    for schema in tool_schemas:
        fn = schema["function"]
        params = fn["parameters"]
        arguments = {**params, "additionalProperties": False}
        example_args = EXAMPLE_ARGUMENTS.get(fn["name"])
        example = None
        if example_args is not None:
            example = {"arguments": example_args}
            if "image" in params.get("properties", {}):
                example["images"] = {"img_1": image}
        paths[f"/v1/tools/{fn['name']}"] = {"post": _operation(fn["description"], arguments, example)}
    first = next((n for n in names if n in EXAMPLE_ARGUMENTS), None)
    generic_example = None
    if first is not None:
        generic_example = {"arguments": EXAMPLE_ARGUMENTS[first], "images": {"img_1": image}}
    any_arguments = {"anyOf": [{**t["function"]["parameters"], "additionalProperties": False} for t in tool_schemas],
                     "description": "The named tool's arguments (see its own path, or GET /v1/tools)."}
    paths["/v1/tools/{name}"] = {"post": _operation(
        "Any tool by name (the same calls as the per-tool paths)", any_arguments, generic_example,
        [{"name": "name", "in": "path", "required": True, "schema": {"type": "string", "enum": names},
          **({"example": first} if first else {})}])}
    doc = {"openapi": "3.1.0", "paths": paths,
           "info": {"title": "osvl tool API", "version": "1",
                    "description": "Tools of the OpenSearch-VL agent (crop, sharpen, super_resolution, "
                                   "perspective_correct, ocr, text_search, image_search) over HTTP."},
           "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc


api = FastAPI(title="osvl tool API", version="1", openapi_url=None, docs_url=None, redoc_url=None)


def _answer(result: ToolResult, multipart: bool = False, status: int | None = None) -> Response:
    if status is None:
        status = 200 if result.ok else 413 if result.error.limit else HTTP_STATUS[result.error.kind]
    if multipart and result.images:
        body, ctype = result_to_multipart(result)
        return Response(body, status_code=status, media_type=ctype)
    return JSONResponse(result_to_wire(result), status_code=status)


SWALLOW_FACTOR = 4


def _unauthorized() -> JSONResponse:
    result = ToolResult.fail("invalid_call", "missing or wrong bearer token")
    return JSONResponse(result_to_wire(result), status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidCall(f"{what} is not JSON: {e}") from None


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64,
                  autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 32})
@serve.ingress(api)
class ToolAPI:
    def __init__(self, handles: dict[str, Any], tool_schemas: list[dict[str, Any]], cfg: dict[str, Any],
                 token_sha256: str = "", inline: dict[str, Tool] | None = None) -> None:
        self.handles = handles
        self.tool_schemas = tool_schemas
        self.cfg = from_dict(ServeConfig, cfg)
        self.token_sha256 = token_sha256  # a digest, so the token is not stored in the app's config
        keep_freed_memory()  # the ingress decodes and encodes every HTTP call's images
        self.inline = {name: _ToolReplica(tool, cfg) for name, tool in (inline or {}).items()}

    def _authorized(self, request: Request) -> bool:
        if not self.token_sha256:
            return True
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            return False
        digest = hashlib.sha256(auth[7:].encode()).hexdigest()
        return hmac.compare_digest(digest, self.token_sha256)

    async def _read_body(self, request: Request) -> bytes:
        """The body, or ``InvalidCall(limit=True)`` past ``max_body_bytes``.

        An oversized body is still read (and dropped) up to ``SWALLOW_FACTOR`` times the limit
        before the 413 goes out: answering mid-upload resets the connection, and simple clients
        (curl, urllib) then report a reset instead of the 413. Beyond that we stop reading.
        """
        limit = self.cfg.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked uploads have no content-length to trust
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > SWALLOW_FACTOR * limit:
                break
        if size > limit:
            raise InvalidCall(f"body of {size}+ bytes exceeds the limit of {limit}", limit=True)
        return b"".join(chunks)

    def _parse(self, raw: bytes, header: str) -> tuple[Any, dict[str, Any], str]:
        """A JSON or multipart body -> (arguments, decoded images, new image name); ``InvalidCall`` if bad."""
        if not raw:
            raise InvalidCall("empty body; expected {\"arguments\": {...}, \"images\": {...}} or multipart parts")
        if content_type(header)[0] == MULTIPART:
            parts = decode_multipart(raw, header)
            if "arguments" not in parts:
                raise InvalidCall(f"multipart call without its 'arguments' part (JSON); got parts {sorted(parts)}")
            arguments = _json(parts.pop("arguments")[1], "the arguments part")
            try:
                new_name = parts.pop("new_image_name", ("", b""))[1].decode()
            except UnicodeDecodeError:
                raise InvalidCall("new_image_name must be UTF-8 text") from None
            # every other part is an image, read from its bytes whatever type it declares: a part without a
            # Content-Type is text/plain by RFC 7578, and the schema (additionalProperties, binary) cannot say more
            odd = sorted(name for name in parts if not PART_NAME.fullmatch(name))
            if odd:
                raise InvalidCall(f"image part names must match {PART_NAME.pattern}, got {odd[:3]}")
            images = {name: image_from_bytes(data, self.cfg.max_pixels, name) for name, (_, data) in parts.items()}
        else:
            body = _json(raw, "body")
            if not isinstance(body, dict):
                raise InvalidCall(f"body must be a JSON object, got {type(body).__name__}")
            unknown = sorted(set(body) - {"arguments", "images", "new_image_name"})
            if unknown:
                raise InvalidCall(f"unknown body field(s) {unknown}")
            arguments = body.get("arguments", {})
            images_b64 = body.get("images", {})
            if not isinstance(images_b64, dict):
                raise InvalidCall(f"images must be a JSON object of name -> base64, got {type(images_b64).__name__}")
            new_name = body.get("new_image_name", "")
            if not isinstance(new_name, str):
                raise InvalidCall("new_image_name must be a string")
            images = {name: decode_image(b64, self.cfg.max_pixels, name) for name, b64 in images_b64.items()}
        if not isinstance(arguments, dict):
            raise InvalidCall(f"arguments must be a JSON object, got {type(arguments).__name__}")
        return arguments, images, new_name

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "tools": sorted(self.handles)}

    @api.get("/openapi.json")
    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(openapi_document(self.tool_schemas, request.scope.get("root_path", "")))

    @api.get("/docs")
    async def docs(self, request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=request.scope.get("root_path", "") + "/openapi.json",
                                   title="osvl tool API")

    @api.get("/v1/tools")
    async def list_tools(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            return _unauthorized()
        return JSONResponse({"tools": self.tool_schemas})

    def schemas(self) -> list[dict[str, Any]]:
        """Handle callers (``HandleTransport.schemas``) get the same list without HTTP."""
        return self.tool_schemas

    @api.post("/v1/tools/{name}")
    async def call(self, name: str, request: Request) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        header = request.headers.get("content-type", "")
        multipart = MULTIPART in request.headers.get("accept", "")
        try:
            raw = await self._read_body(request)
            if content_type(header)[0] not in ("application/json", MULTIPART):
                return _answer(ToolResult.fail("invalid_call", f"Content-Type {header or '(none)'} is neither "
                                               f"application/json nor {MULTIPART}"), status=415)
            if name not in self.handles:
                raise InvalidCall(f"unknown tool {name!r}; known: {sorted(self.handles)}")
            if name in self.inline:
                return await self._call_inline(name, raw, header, multipart)
            arguments, images, new_name = await asyncio.to_thread(self._parse, raw, header)
        except InvalidCall as e:
            return _answer(ToolResult.fail("invalid_call", str(e), limit=e.limit))
        response = self.handles[name].remote(arguments, images, new_name)
        try:
            result = await asyncio.wait_for(response, self.cfg.timeout_s)
        except TimeoutError:
            response.cancel()
            result = ToolResult.fail("timeout", f"{name} took longer than {self.cfg.timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - typed by ray_failure
            result = ray_failure(name, e)
        if result.ok and result.images:
            return await asyncio.to_thread(_answer, result, multipart)  # PNG encoding is CPU work
        return _answer(result)

    async def _call_inline(self, name: str, raw: bytes, header: str, multipart: bool) -> Response:
        """Decode, run and encode in one worker thread of this replica: no second hop, no array pickled.

        Why: for a tool that costs a few milliseconds, the hop ingress -> tool replica (the arrays
        pickled both ways, a second Serve request) cost as much as the tool and made osvl's HTTP
        slower than a one-deployment app (``bench/tools.py``). The deadline is the same as for a
        forwarded call; like an in-process call, a thread past it finishes unobserved.
        """

        def work() -> Response:
            try:
                arguments, images, new_name = self._parse(raw, header)
            except InvalidCall as e:
                return _answer(ToolResult.fail("invalid_call", str(e), limit=e.limit))
            return _answer(self.inline[name]._run(arguments, images, new_name), multipart)

        try:
            return await asyncio.wait_for(asyncio.to_thread(work), self.cfg.timeout_s)
        except TimeoutError:
            return _answer(ToolResult.fail("timeout", f"{name} took longer than {self.cfg.timeout_s:g} s"))


# ---------------------------------------------------------------------------


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder (``import_path: serve.app:build_app``; ``args`` = ServeConfig fields)."""
    cfg = from_dict(ServeConfig, dict(args or {}))
    refuse_open_without_token(cfg)
    return make_app(all_tools(), cfg)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_host(cfg: Any) -> None:
    """``ConfigError`` when a service's ``cfg.host`` is off loopback and its token (``cfg.token_env``) is not set:
    the rule of the agent service and the MCP server, which bind their own host (the tool API's is Serve's:
    ``refuse_open_without_token``)."""
    if cfg.host not in LOOPBACK_HOSTS and not os.environ.get(cfg.token_env):
        raise ConfigError(f"refusing to serve on {cfg.host} without a bearer token: set {cfg.token_env} where the "
                          "app is built, or keep host at 127.0.0.1")


def refuse_open_without_token(cfg: ServeConfig) -> None:
    """Raise ``ConfigError`` (one line) when Serve's HTTP proxy binds beyond loopback and no token is set.

    The host is the running Serve instance's (``serve run``/``serve deploy`` with ``http_options.host``,
    a KubeRay RayService), else the one Serve would start with (``RAY_SERVE_DEFAULT_HTTP_HOST``).
    """
    host = HTTPOptions().host
    if ray.is_initialized():
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is not None:
            host = client.http_config.host
    if host in (None, *LOOPBACK_HOSTS) or os.environ.get(cfg.token_env):
        return

    raise ConfigError(f"refusing to serve the tool API on {host} without a bearer token: "
                      f"set {cfg.token_env} where the app is built, or bind http_options.host to 127.0.0.1")


def make_app(tools: dict[str, Tool], cfg: ServeConfig,
             deployments: dict[str, dict[str, Any]] | None = None) -> serve.Application:
    """The application for ``tools`` (a registry); the Tool objects travel to their replicas by value.

    ``deployments`` maps deployment names (``api``, ``tool_<name>``) to ``.options()`` overrides,
    the same keys as a Serve config's ``deployments:`` entries (replicas, autoscaling, resources).
    """
    names = cfg.tools or sorted(tools)
    missing = sorted(set(names) - set(tools))
    if missing:
        raise ConfigError(f"tools {missing} are not registered; known: {sorted(tools)}")
    overrides = dict(deployments or {})
    cfg_dict = dataclasses.asdict(cfg)
    handles = {}
    for name in names:
        cls = BatchedToolDeployment if name in cfg.batched else ToolDeployment
        dep = DEPLOYMENT_PREFIX + name
        handles[name] = cls.options(name=dep, **_placed(cls, overrides.pop(dep, {}), cfg)).bind(tools[name],
                                                                                                  cfg_dict)
    api_options = _placed(ToolAPI, overrides.pop("api", {}), cfg)
    if overrides:
        raise ConfigError(f"options for unknown deployments {sorted(overrides)}")
    both = sorted(set(cfg.inline) & set(cfg.batched))
    if both:
        raise ConfigError(f"tools {both} are both inline and batched: an inline call would skip the batch")
    token = os.environ.get(cfg.token_env, "")
    digest = hashlib.sha256(token.encode()).hexdigest() if token else ""
    inline = {n: tools[n] for n in names if n in cfg.inline}
    return ToolAPI.options(name="api", **api_options).bind(handles, [tools[n].schema for n in names], cfg_dict,
                                                           digest, inline)


def run_unless_running(cfg: ServeConfig | None = None, route_prefix: str = "/tools") -> None:
    """Run the tool app (``APP_NAME``) on the running Serve instance at ``route_prefix`` unless it runs already:
    services that call the tools through handles (the agent, the MCP server) start it beside themselves."""
    app = serve.status().applications.get(APP_NAME)
    if app is None or str(app.status).rsplit(".", 1)[-1] != "RUNNING":
        serve.run(make_app(all_tools(), cfg or ServeConfig()), name=APP_NAME, route_prefix=route_prefix)


def _placed(cls: Any, options: dict[str, Any], cfg: ServeConfig) -> dict[str, Any]:
    """``options`` with ``cfg.role_units`` of the tools resource added to the replica's ray_actor_options
    (the deployment's own, or the ones ``options`` gives, which replace them in Serve)."""
    if cfg.role_units <= 0:
        return options

    actor = dict(options.get("ray_actor_options") or cls.ray_actor_options or {})
    actor["resources"] = {**actor.get("resources", {}), **role_resources("tools", cfg.role_units)}
    return {**options, "ray_actor_options": actor}


def main(argv: list[str] | None = None) -> None:
    """``python -m serve.app [--config=serve/config.yaml] [--port=N] [--<ServeConfig field>=value ...]``.

    Starts a loopback Ray cluster (or joins ``$RAY_ADDRESS``), runs the app and serves until Ctrl-C.
    ``--config`` reads a Serve config file (its first application's ``args`` and ``deployments``)
    so the laptop run and ``serve run`` use one file; later flags override its args.
    """
    argv = normalize_args(list(sys.argv[1:] if argv is None else argv))
    cfg, deployments = ServeConfig(), {}
    for arg in [a for a in argv if a.startswith("--config=")]:  # the file first, then flags override its args
        app_cfg = load_yaml(arg.partition("=")[2])["applications"][0]
        cfg = merge(cfg, app_cfg.get("args") or {})
        deployments = {d["name"]: {k: v for k, v in d.items() if k != "name"}
                       for d in app_cfg.get("deployments") or []}
    port, cfg = service_flags([a for a in argv if not a.startswith("--config=")], cfg, "serve.app [--config=FILE]")
    tools = all_tools()
    names = set(cfg.tools or tools)  # a subset run keeps only its own deployments' options
    deployments = {k: v for k, v in deployments.items() if k == "api" or k.removeprefix(DEPLOYMENT_PREFIX) in names}
    init_ray()
    port = start_serve(port or None)
    serve.run(make_app(tools, cfg, deployments), name=APP_NAME, route_prefix="/")
    logging.getLogger("serve.app").info(f"osvl tool API on http://127.0.0.1:{port} (OpenAPI: /docs, /openapi.json)")
    serve_until_interrupted()


def service_flags(argv: list[str], cfg: Any, module: str) -> tuple[int, Any]:
    """A service's command line (``python -m serve.<module>``), parsed as the jobs' are (``--key=value`` or
    ``--key value``): ``--port=N``, ``--log_level=LEVEL``, ``--help`` (every field with the value this command
    line gives it, then exit), ``--print_config`` (the resolved config, then exit) and ``--<field>=value``
    overrides; sets up logging. Returns (port, 0 = a free one; the config with the overrides)."""
    port, argv = 0, normalize_args(argv)
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if arg in ("--help", "--print_config"):
            continue
        if key == "port":
            if not value.isdigit():
                raise ConfigError(f"--port: expected a port number, got {value!r}")
            port = int(value)
        elif key == "log_level":
            setup(value)
        else:
            cfg = apply_override(cfg, key, value)
    if "--help" in argv:
        print(format_help(type(cfg), defaults=cfg, usage=f"usage: python -m {module} [--port=N] [--print_config] "
                          "[--log_level=debug|info|warning|error] [--key=value | --key value ...]"))
        raise SystemExit(0)
    if "--print_config" in argv:
        print(dump(cfg), end="", flush=True)
        raise SystemExit(0)
    setup()  # info unless --log_level chose (or $OSVL_LOG_LEVEL)
    return port, cfg


def serve_until_interrupted() -> None:
    """Keep this driver alive until Ctrl-C: the Serve apps it ran are shut down with it."""
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    # Run the importable module, not this `__main__` copy: Ray pickles `__main__` classes by value, and
    # what they reference by name (the cached `keep_freed_memory`) is then missing in the replicas.
    from osvl.config import cli
    from serve.app import main as _main

    cli(_main)
