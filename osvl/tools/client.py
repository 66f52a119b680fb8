"""One async tool client, three transports: HTTP, Serve deployment handles, in-process.

Callers (the agent loop, rollout actors, eval, benchmarks) write
``await client.call("crop", {"image": "img_1", ...}, images)`` and get a typed
``ToolResult`` back whatever the transport:

- ``http``: callers outside the cluster talk to ``serve/app.py``'s ingress with
  aiohttp. By default a call is one ``multipart/form-data`` body (an ``arguments``
  JSON part, one PNG part per image) and an answer with new images comes back the
  same way, so no image is base64-coded or parsed out of megabytes of JSON;
  ``HttpTransport(binary=False)`` speaks the base64 JSON that curl users send.
- ``handle``: callers inside the cluster (rollout actors) call each tool's Serve
  deployment directly; no HTTP, no base64, the arrays go through Ray's object
  store (the same ``ToolResult`` object comes back).
- ``inprocess``: single-process runs call the registered tool function in a
  worker thread (numpy/OpenCV/torch release the GIL, so the event loop keeps
  serving other episodes).

Failures are values, never exceptions: a transport that cannot reach the tool
returns ``ToolResult.fail("unavailable", ...)``, a call past its deadline
``timeout``. Only ``unavailable`` is retried (bounded, with backoff): tools are
pure functions of their inputs, so repeating a call is safe, while a timed-out
call may still be running and repeating it would double the load exactly when
the service is slow.

This module also holds the wire codec (PNG images, header-checked before any
pixel is decoded; base64 JSON and multipart bodies) because the HTTP server and the
HTTP client must agree on it byte for byte.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import re
import secrets
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from osvl import metrics as M
from osvl.tools.base import MAX_PIXELS, REGISTRY, InvalidCall, Tool, ToolContext, ToolResult, call_tool
from osvl.tools.cache import ToolCache
from osvl.tools.registry import all_tools

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
"""Formats the HTTP API decodes; fewer decoders, less attack surface."""

HTTP_STATUS = {"invalid_call": 422, "tool_error": 200, "timeout": 504, "unavailable": 503}
"""HTTP status of each result kind (``ok`` is 200; an over-limit ``invalid_call`` is 413)."""

DEPLOYMENT_PREFIX = "tool_"
"""Serve deployment name of tool ``x`` is ``tool_x`` (serve/app.py and the handle transport agree)."""


# ---------------------------------------------------------------------------
# wire codec


def png_bytes(arr: np.ndarray) -> bytes:
    """RGB uint8 array -> PNG (lossless, so tools see exactly the pixels that were sent).

    Why these settings: zlib level 1 with the SUB filter and run-length matching makes files as
    small as OpenCV's default level-1 PNG (465 KB for a 512x512 photo) at a third of its encoding
    time, and they decode twice as fast; PNG coding, not the tools, was most of an HTTP call's CPU.
    """
    import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected an RGB uint8 array, got {type(arr).__name__} {getattr(arr, 'shape', '')}")
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(arr[:, :, ::-1]),
                           [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_SUB,
                            cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE])
    if not ok:
        raise ValueError("PNG encoding failed")
    return buf.tobytes()


def encode_image(arr: np.ndarray) -> str:
    """RGB uint8 array -> base64 PNG, for JSON bodies."""
    return base64.b64encode(png_bytes(arr)).decode("ascii")


def decode_image(data: Any, max_pixels: int = MAX_PIXELS, name: str = "image") -> np.ndarray:
    """base64 image (JSON bodies) -> RGB uint8 array; raises ``InvalidCall`` like ``image_from_bytes``."""
    if not isinstance(data, str):
        raise InvalidCall(f"images.{name} must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidCall(f"images.{name}: invalid base64 ({e})") from None
    return image_from_bytes(raw, max_pixels, name)


def image_from_bytes(raw: bytes, max_pixels: int = MAX_PIXELS, name: str = "image") -> np.ndarray:
    """PNG/JPEG/WebP bytes -> RGB uint8 array; raises ``InvalidCall`` (``limit=True`` for oversize).

    The pixel count is read from the file header *before* any pixel is decoded:
    a 20,000 x 20,000 PNG of zeros is a few kilobytes on the wire and 1.2 GB in
    memory (a decompression bomb).
    """
    if not raw:
        raise InvalidCall(f"images.{name}: empty image data")
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR":
        # PIL refuses > 179 MP itself, at a limit we do not set; check ours first with a clear message
        _check_pixels(int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big"), max_pixels, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:
        raise InvalidCall(f"images.{name}: {e}", limit=True) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for garbage bytes
        raise InvalidCall(f"images.{name}: not a {'/'.join(IMAGE_FORMATS)} image ({type(e).__name__})") from None
    _check_pixels(*img.size, max_pixels, name)
    try:
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise InvalidCall(f"images.{name}: corrupt image data ({type(e).__name__}: {e})") from None
    return arr


def _check_pixels(w: int, h: int, max_pixels: int, name: str) -> None:
    if w * h > max_pixels:
        raise InvalidCall(f"images.{name}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}", limit=True)


def result_to_wire(result: ToolResult) -> dict[str, Any]:
    """``ToolResult`` -> JSON body of the HTTP API (new images as base64 PNG)."""
    body = _result_head(result)
    body["images"] = {k: encode_image(v) for k, v in result.images.items()}
    return body


def _result_head(result: ToolResult) -> dict[str, Any]:
    body = result.to_json()
    if result.error is not None and result.error.limit:
        body["error"]["limit"] = True
    return body


def result_from_wire(body: Any) -> ToolResult:
    """JSON body of the HTTP API -> ``ToolResult``; a body that is not one is ``unavailable``."""
    if not isinstance(body, dict) or body.get("status") != "ok":
        return _result(body, {})
    if not isinstance(body.get("images") or {}, dict):
        return ToolResult.fail("unavailable", f"malformed response body: {str(body)[:200]}")
    try:
        images = {k: image_from_bytes(_b64(v, k), name=k) for k, v in (body.get("images") or {}).items()}
    except InvalidCall as e:
        return ToolResult.fail("unavailable", f"undecodable image in response: {e}")
    return _result(body, images)


def _b64(value: Any, name: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise InvalidCall(f"images.{name}: invalid base64 ({e})") from None


def _result(head: Any, images: dict[str, np.ndarray]) -> ToolResult:
    """The result fields of a JSON or multipart answer (its images already decoded) -> ``ToolResult``."""
    if not isinstance(head, dict) or head.get("status") not in ("ok", "error"):
        return ToolResult.fail("unavailable", f"malformed response body: {str(head)[:200]}")
    err = head.get("error")
    if head["status"] == "error":
        if not isinstance(err, dict) or err.get("kind") not in HTTP_STATUS:
            return ToolResult.fail("unavailable", f"malformed error in response: {str(err)[:200]}")
        result = ToolResult.fail(err["kind"], str(err.get("message", "")), limit=bool(err.get("limit")))
        result.data = head.get("data") or {}
        return result
    return ToolResult("ok", str(head.get("text", "")), images, None, head.get("data") or {})


# ---------------------------------------------------------------------------
# multipart bodies: the binary transport

MULTIPART = "multipart/form-data"

PART_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # the part names we write and the tool API accepts
_PARAM = re.compile(r';\s*([A-Za-z0-9_\-]+)=("([^"\\\r\n]*)"|[^;\s]*)')


def content_type(header: str) -> tuple[str, dict[str, str]]:
    """``'multipart/form-data; boundary=x'`` -> ``('multipart/form-data', {'boundary': 'x'})``."""
    kind, _, rest = header.partition(";")
    params = {m.group(1).lower(): m.group(3) if m.group(3) is not None else m.group(2)
              for m in _PARAM.finditer(";" + rest)}
    return kind.strip().lower(), params


def encode_multipart(parts: list[tuple[str, str, bytes]]) -> tuple[bytes, str]:
    """``(name, content type, data)`` parts -> (body, Content-Type header); names must be simple tokens."""
    boundary = "osvl-" + secrets.token_hex(16)
    out = []
    for name, ctype, data in parts:
        if not PART_NAME.fullmatch(name):
            raise ValueError(f"part name {name!r} must match [A-Za-z0-9_.-]{{1,128}}")
        filename = f'; filename="{name}"' if ctype.startswith("image/") else ""
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{filename}\r\n'
                   f"Content-Type: {ctype}\r\n\r\n".encode() + data + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"{MULTIPART}; boundary={boundary}"


def decode_multipart(body: bytes, header: str) -> dict[str, tuple[str, bytes]]:
    """A ``multipart/form-data`` body -> ``{name: (content type, data)}``; ``InvalidCall`` if malformed.

    Strict on purpose (RFC 7578 as browsers, curl and requests write it): every part has a
    ``Content-Disposition: form-data; name=...`` header, names are unique, and the body ends
    with the closing delimiter, so a truncated upload is an error rather than a shorter call.
    The body is already in memory (read up to ``max_body_bytes``), so splitting is enough.
    """
    kind, params = content_type(header)
    boundary = params.get("boundary", "")
    if kind != MULTIPART:
        raise InvalidCall(f"expected {MULTIPART}, got {kind or 'no content type'}")
    if not 1 <= len(boundary) <= 70 or any(c in boundary for c in "\r\n"):
        raise InvalidCall("multipart body without a valid boundary parameter")
    chunks = (b"\r\n" + body).split(b"\r\n--" + boundary.encode())
    if len(chunks) < 2:
        raise InvalidCall("multipart body without its boundary")
    parts: dict[str, tuple[str, bytes]] = {}
    for chunk in chunks[1:]:
        if chunk.startswith(b"--"):
            return parts  # the closing delimiter; what follows is the epilogue
        head, sep, data = chunk.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"\r\n"):
            raise InvalidCall("malformed multipart part (no blank line after its headers)")
        headers = {}
        for line in head[2:].split(b"\r\n"):
            key, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise InvalidCall(f"malformed multipart header {line[:80]!r}")
            headers[key.strip().lower()] = value.strip()
        disposition, dparams = content_type(headers.get("content-disposition", ""))
        name = dparams.get("name", "")
        if disposition != "form-data" or not name:
            raise InvalidCall("every multipart part needs Content-Disposition: form-data; name=\"...\"")
        if name in parts:
            raise InvalidCall(f"multipart part {name!r} appears twice")
        parts[name] = (content_type(headers.get("content-type", "text/plain"))[0], data)
    raise InvalidCall("truncated multipart body (no closing boundary)")


def result_from_multipart(body: bytes, header: str) -> ToolResult:
    """A multipart answer (a ``result`` JSON part, one PNG part per new image) -> ``ToolResult``."""
    try:
        parts = decode_multipart(body, header)
        head = json.loads(parts.pop("result", ("", b""))[1])
        names = head.get("images") if isinstance(head, dict) else None
        if not isinstance(names, list) or sorted(names) != sorted(parts):
            raise InvalidCall(f"image parts {sorted(parts)} do not match the result's images {names}")
        images = {k: image_from_bytes(data, name=k) for k, (_, data) in parts.items()}
    except (InvalidCall, ValueError) as e:
        return ToolResult.fail("unavailable", f"malformed multipart response: {e}")
    return _result(head, images)


def result_to_multipart(result: ToolResult) -> tuple[bytes, str]:
    """``ToolResult`` -> multipart answer body and its Content-Type (what ``result_from_multipart`` reads)."""
    head = json.dumps(_result_head(result)).encode()
    return encode_multipart([("result", "application/json", head)]
                            + [(k, "image/png", png_bytes(v)) for k, v in result.images.items()])


# ---------------------------------------------------------------------------
# transports: each answers one attempt with a ToolResult, never raises


class InProcessTransport:
    """Run registered tool functions in this process (one thread per call)."""

    def __init__(self, tools: Mapping[str, Tool] | None = None, max_pixels: int = MAX_PIXELS,
                 options: dict[str, Any] | None = None) -> None:
        self.tools = tools if tools is not None else REGISTRY
        self.max_pixels = max_pixels
        self.options = options or {}

    async def call(self, name: str, arguments: Any, images: Mapping[str, np.ndarray], new_image_name: str,
                   timeout_s: float) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult.fail("invalid_call", f"unknown tool {name!r}; known: {sorted(self.tools)}")
        ctx = ToolContext(images, new_image_name, self.max_pixels, self.options)
        try:
            # the thread keeps running after a timeout (threads cannot be killed); the caller moves on
            return await asyncio.wait_for(asyncio.to_thread(call_tool, tool, arguments, ctx), timeout_s)
        except TimeoutError:
            return ToolResult.fail("timeout", f"{name} took longer than {timeout_s:g} s")

    async def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def close(self) -> None:
        pass


def ray_failure(name: str, e: BaseException) -> ToolResult:
    """Type an exception raised by a Serve handle call: infrastructure -> unavailable, else tool_error."""
    from ray.exceptions import RayActorError, RayTaskError  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help
    from ray.serve.exceptions import (  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
        RequestCancelledError,
    )

    transient = (RayActorError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError,
                 RequestCancelledError)
    if isinstance(e, transient):
        return ToolResult.fail("unavailable", f"{name}: {type(e).__name__}: {str(e)[:300]}")
    if isinstance(e, RayTaskError):
        return ToolResult.fail("tool_error", f"{name}: {type(e).__name__}: {str(e)[:300]}")
    return ToolResult.fail("unavailable", f"{name}: {type(e).__name__}: {str(e)[:300]}")


class HandleTransport:
    """Call each tool's Serve deployment through a ``DeploymentHandle`` (inside the cluster).

    Two things make this path cheap enough to replace in-process calls in rollout actors:

    - Images go into Ray's object store once per array and travel as ``ObjectRef``s: an episode
      sends ``img_1`` with every call, and re-serialising it each time costs more than most
      tools. The cache is keyed by array identity (a weak reference, so the object is freed
      with the array); arrays are treated as immutable values, as everywhere in osvl: an array
      changed in place after a call would be sent stale.
    - Calls to one tool issued in the same event-loop tick (a rollout actor runs many episodes
      concurrently) travel as one Serve request (``call_many``), so Serve's fixed per-request
      cost is paid once per group; the replica still runs and meters each call on its own. A
      lone call is sent on the next tick, so nothing waits for company. Groups hold at most
      ``group_size`` calls (larger groups gain less and less: docs/measurements.md), so a large
      burst still spreads over replicas.
    """

    def __init__(self, app_name: str = "osvl_tools", group_size: int = 16) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.app_name = app_name
        self.group_size = group_size
        self._handles: dict[str, Any] = {}
        self._refs: dict[int, tuple[Any, Any]] = {}  # id(array) -> (weakref to it, ObjectRef)
        self._pending: dict[str, list[tuple[tuple[Any, Any, str], asyncio.Future]]] = {}

    def _handle(self, name: str) -> Any:
        if name not in self._handles:
            from ray import serve  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help

            self._handles[name] = serve.get_deployment_handle(DEPLOYMENT_PREFIX + name, app_name=self.app_name)
        return self._handles[name]

    def _ref(self, arr: Any) -> Any:
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help

        if not isinstance(arr, np.ndarray):
            return arr  # the replica's validation answers invalid_call
        key = id(arr)
        hit = self._refs.get(key)
        if hit is not None and hit[0]() is arr:
            return hit[1]
        ref = ray.put(arr)
        self._refs[key] = (weakref.ref(arr, lambda _, key=key: self._refs.pop(key, None)), ref)
        return ref

    async def call(self, name: str, arguments: Any, images: Mapping[str, np.ndarray], new_image_name: str,
                   timeout_s: float) -> ToolResult:
        try:
            self._handle(name)
            refs = {k: self._ref(v) for k, v in images.items()}
        except (KeyError, ValueError) as e:
            return ToolResult.fail("invalid_call", f"unknown tool {name!r} in app {self.app_name!r}: {e}")
        except Exception as e:  # noqa: BLE001 - controller unreachable, app not deployed
            return ray_failure(name, e)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        group = self._pending.setdefault(name, [])
        group.append(((arguments, refs, new_image_name), future))
        if len(group) == 1:
            loop.call_soon(lambda: loop.create_task(self._send(name)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return ToolResult.fail("timeout", f"{name} took longer than {timeout_s:g} s")

    async def _send(self, name: str) -> None:
        pending = self._pending.pop(name, [])
        size = self.group_size
        await asyncio.gather(*[self._send_group(name, pending[i:i + size]) for i in range(0, len(pending), size)])

    async def _send_group(self, name: str, group: list[tuple[tuple[Any, Any, str], asyncio.Future]]) -> None:
        try:
            results = await self._handle(name).call_many.remote([call for call, _ in group])
        except Exception as e:  # noqa: BLE001 - the whole group failed the same way
            results = [ray_failure(name, e)] * len(group)
        if not isinstance(results, list) or len(results) != len(group):
            got = len(results) if isinstance(results, list) else type(results).__name__
            results = [ToolResult.fail("tool_error", f"{name}: call_many answered {got} for {len(group)} calls")
                       ] * len(group)
        for (_, future), result in zip(group, results, strict=True):
            if not future.done():  # a caller that timed out has cancelled its future
                future.set_result(result)

    async def schemas(self) -> list[dict[str, Any]]:
        from ray import serve  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help

        return await serve.get_deployment_handle("api", app_name=self.app_name).schemas.remote()

    async def close(self) -> None:
        self._refs.clear()


def _json_body(arguments: Any, images: Mapping[str, np.ndarray], new_image_name: str) -> tuple[bytes, str]:
    body: dict[str, Any] = {"arguments": arguments, "images": {k: encode_image(v) for k, v in images.items()}}
    if new_image_name:
        body["new_image_name"] = new_image_name
    return json.dumps(body).encode(), "application/json"


def _multipart_body(arguments: Any, images: Mapping[str, np.ndarray], new_image_name: str) -> tuple[bytes, str]:
    parts = [("arguments", "application/json", json.dumps(arguments).encode())]
    if new_image_name:
        parts.append(("new_image_name", "text/plain", new_image_name.encode()))
    if {"arguments", "new_image_name"} & set(images):
        raise ValueError("images may not be named 'arguments' or 'new_image_name' in a multipart call")
    return encode_multipart(parts + [(k, "image/png", png_bytes(v)) for k, v in images.items()])


class HttpTransport:
    """Talk to the tool API over HTTP (outside the cluster).

    ``binary`` (the default) sends each call as ``multipart/form-data`` and accepts a multipart
    answer; ``binary=False`` sends base64 JSON, as curl users do. Both reach the same route.
    """

    def __init__(self, url: str, token: str | None = None, connections: int = 64, binary: bool = True) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.connections = connections
        self.binary = binary
        self._session: Any = None

    def _sess(self) -> Any:
        if self._session is None:
            import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections),
                                                  headers=self.headers)
        return self._session

    async def call(self, name: str, arguments: Any, images: Mapping[str, np.ndarray], new_image_name: str,
                   timeout_s: float) -> ToolResult:
        import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

        encode = _multipart_body if self.binary else _json_body
        try:
            data, ctype = await asyncio.to_thread(encode, arguments, images, new_image_name)
        except (TypeError, ValueError) as e:  # not an image, or arguments that are not JSON
            return ToolResult.fail("invalid_call", f"{name}: {e}")
        accept = f"{MULTIPART}, application/json" if self.binary else "application/json"
        try:
            async with self._sess().post(f"{self.url}/v1/tools/{name}", data=data,
                                         headers={"Content-Type": ctype, "Accept": accept},
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                status = resp.status
                answer_type = resp.headers.get("Content-Type", "")
                raw = await resp.read()
        except TimeoutError:
            return ToolResult.fail("timeout", f"{name}: no HTTP answer within {timeout_s:g} s")
        except aiohttp.ClientError as e:
            return ToolResult.fail("unavailable", f"{name}: {type(e).__name__}: {e}")
        if content_type(answer_type)[0] == MULTIPART:
            return await asyncio.to_thread(result_from_multipart, raw, answer_type)  # PNG decoding is CPU work
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            kind = {401: "invalid_call", 413: "invalid_call", 415: "invalid_call", 422: "invalid_call",
                    504: "timeout"}.get(status, "unavailable")
            return ToolResult.fail(kind, f"{name}: HTTP {status} without a JSON body", limit=status == 413)
        if status in (401, 404) and not isinstance(payload.get("error"), dict):
            return ToolResult.fail("invalid_call", f"{name}: HTTP {status}: {str(payload)[:200]}")
        return await asyncio.to_thread(result_from_wire, payload)

    async def schemas(self) -> list[dict[str, Any]]:
        async with self._sess().get(f"{self.url}/v1/tools") as resp:
            resp.raise_for_status()
            return (await resp.json())["tools"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# ---------------------------------------------------------------------------


class ToolClient:
    """Timeouts and bounded retries over one transport; every failure is a typed ``ToolResult``.

    ``stats`` counts attempts and retries (tests and benchmarks read it).
    """

    def __init__(self, transport: Any, *, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.2) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s must be > 0, retries and backoff_s >= 0")
        self.transport = transport
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.stats = {"calls": 0, "attempts": 0, "retries": 0}

    async def call(self, name: str, arguments: Any, images: Mapping[str, np.ndarray] | None = None,
                   new_image_name: str = "") -> ToolResult:
        """One tool call; ``unavailable`` is retried up to ``retries`` times within one overall deadline."""
        images = images or {}
        self.stats["calls"] += 1
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return ToolResult.fail("timeout", f"{name}: no answer within {self.timeout_s:g} s")
            self.stats["attempts"] += 1
            result = await self.transport.call(name, arguments, images, new_image_name, left)
            if result.ok or result.error.kind != "unavailable" or attempt >= self.retries:
                return result
            attempt += 1
            self.stats["retries"] += 1
            await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), max(deadline - time.monotonic(), 0)))

    async def schemas(self) -> list[dict[str, Any]]:
        return await self.transport.schemas()

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def make_client(transport: str = "inprocess", *, url: str = "", token: str | None = None,
                app_name: str = "osvl_tools", tools: Mapping[str, Tool] | None = None, binary: bool = True,
                options: dict[str, Any] | None = None, **kwargs: Any) -> ToolClient:
    """Build a ``ToolClient``: ``transport`` is ``inprocess`` (``tools``, default every registered one, with
    ``options`` as their ``ToolContext.options``: the search backends), ``handle`` or ``http`` (which needs
    ``url``; ``binary=False`` makes it send base64 JSON instead of multipart). Jobs and services build their
    client through ``osvl.agent.env.build_env``."""
    if transport == "inprocess":
        if tools is None:
            tools = all_tools()
        return ToolClient(InProcessTransport(tools, options=options), **kwargs)
    if transport == "handle":
        return ToolClient(HandleTransport(app_name), **kwargs)
    if transport == "http":
        if not url:
            raise ValueError("the http transport needs url='http://host:port'")
        return ToolClient(HttpTransport(url, token, binary=binary), **kwargs)
    raise ValueError(f"unknown transport {transport!r}; expected inprocess, handle or http")


class CachedInProcess:
    """The in-process tool transport with every call going through the record/replay cache.

    Tools are pure functions of their inputs, so replaying a recorded answer is the same
    answer; the reverse image search, the slowest tool on CPU, is what it saves.
    """

    def __init__(self, mode: str, root: str = "", options: dict[str, Any] | None = None,
                 tools: Mapping[str, Tool] | None = None) -> None:
        self.inner = InProcessTransport(tools, options=options)
        self.cache = ToolCache(root or None, mode=mode)

    async def call(self, name: str, arguments: Any, images: Any, new_image_name: str, timeout_s: float) -> Any:
        tool = self.inner.tools.get(name)
        if tool is None:
            return ToolResult.fail("invalid_call", f"unknown tool {name!r}; known: {sorted(self.inner.tools)}")
        ctx = ToolContext(images, new_image_name, self.inner.max_pixels, self.inner.options)
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.cache.call, tool, arguments, ctx), timeout_s)
        except TimeoutError:
            return ToolResult.fail("timeout", f"{name} took longer than {timeout_s:g} s")

    async def schemas(self) -> list[dict[str, Any]]:
        return await self.inner.schemas()

    async def close(self) -> None:
        pass


class MeteredClient:
    """A tool client whose every call takes ``delay`` seconds longer (the benchmark's simulated latency) and,
    given a recorder, is metered as the agent sees it: latency and result by tool (``osvl_rollout_tool_*``)."""

    def __init__(self, inner: Any, delay: float, recorder: Any = None) -> None:
        self.inner, self.delay, self.rec = inner, delay, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if self.delay > 0:
            await asyncio.sleep(self.delay)
        result = await self.inner.call(name, *args, **kwargs)
        if self.rec is not None:
            self.rec.observe(M.ROLLOUT_TOOL_LATENCY, time.perf_counter() - t0, tool=name)
            self.rec.inc(M.ROLLOUT_TOOL_RESULTS, 1, tool=name, status="ok" if result.ok else result.error.kind)
        return result
