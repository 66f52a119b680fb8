"""osvl.tools.client without a cluster: the wire codec, the in-process transport, timeouts and retries.

The handle and HTTP transports against a live Serve app are exercised in tests/test_serve.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from osvl.cluster import free_port
from osvl.tools.base import InvalidCall, Tool, ToolContext, ToolResult, number
from osvl.tools.client import (
    HttpTransport,
    InProcessTransport,
    ToolClient,
    decode_image,
    decode_multipart,
    encode_image,
    encode_multipart,
    image_from_bytes,
    make_client,
    png_bytes,
    result_from_multipart,
    result_from_wire,
    result_to_multipart,
    result_to_wire,
)


def bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
    """A valid 1-bit grey PNG of ``width`` x ``height`` zeros: ~50 KB on disk, 1.2 GB once decoded to RGB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _flip(ctx: ToolContext, image=None, k=1) -> ToolResult:
    img = ctx.image(image)
    number({"k": k}, "k", lo=0, hi=3, integer=True)
    name = ctx.next_name()
    return ToolResult("ok", f"Flipped {image} as {name}.", images={name: np.ascontiguousarray(img[:, ::-1])})


def _slow(ctx: ToolContext, seconds=0.0) -> ToolResult:
    time.sleep(number({"seconds": seconds}, "seconds", lo=0, hi=5))
    return ToolResult("ok", "slept")


TOOLS = {
    "flip": Tool("flip", "Mirror an image.", {"type": "object", "properties": {
        "image": {"type": "string"}, "k": {"type": "integer"}}, "required": ["image"]}, _flip),
    "slow": Tool("slow", "Sleep.", {"type": "object", "properties": {"seconds": {"type": "number"}}}, _slow),
}


def rgb(h: int = 37, w: int = 53, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_codec_roundtrip_is_lossless_and_handles_other_modes():
    img = rgb()
    assert np.array_equal(decode_image(encode_image(img)), img)
    buf = io.BytesIO()
    Image.fromarray(img[:, :, 0]).save(buf, format="PNG")  # greyscale input comes back as RGB
    grey = decode_image(base64.b64encode(buf.getvalue()).decode())
    assert grey.shape == (37, 53, 3) and np.array_equal(grey[:, :, 1], img[:, :, 0])


def test_decode_rejects_bombs_from_the_header_before_decoding():
    data = base64.b64encode(bomb_png()).decode()
    assert len(data) < 200_000
    t = time.perf_counter()
    with pytest.raises(InvalidCall) as e:
        decode_image(data, max_pixels=40_000_000)
    assert e.value.limit and "20000x20000" in str(e.value)
    assert time.perf_counter() - t < 1.0  # 1.2 GB of pixels would take far longer to inflate
    small = base64.b64encode(bomb_png(64, 64)).decode()
    assert decode_image(small).shape == (64, 64, 3)
    with pytest.raises(InvalidCall) as e:
        decode_image(small, max_pixels=4095)
    assert e.value.limit


@pytest.mark.parametrize("data, why", [
    ("not base64!!", "invalid base64"),
    (base64.b64encode(b"hello world, not an image").decode(), "not a PNG/JPEG/WEBP"),
    ("", "empty"),
    (12, "base64 string"),
    (encode_image(rgb(64, 64))[:4000], "corrupt"),  # a noise PNG cut inside its pixel data
])
def test_decode_rejects_garbage_with_a_typed_error(data, why):
    with pytest.raises(InvalidCall) as e:
        decode_image(data)
    assert why in str(e.value) and not e.value.limit


def test_wire_roundtrip_of_results():
    ok = ToolResult("ok", "Flipped.", {"img_2": rgb()}, data={"boxes": [[1, 2]]})
    back = result_from_wire(result_to_wire(ok))
    assert back.ok and back.text == "Flipped." and back.data == {"boxes": [[1, 2]]}
    assert np.array_equal(back.images["img_2"], ok.images["img_2"])
    err = result_from_wire(result_to_wire(ToolResult.fail("invalid_call", "too big", limit=True)))
    assert err.error.kind == "invalid_call" and err.error.limit and err.text == "Error (invalid_call): too big"
    assert result_from_wire({"detail": "nope"}).error.kind == "unavailable"
    assert result_from_wire({"status": "error", "error": {"kind": "weird"}}).error.kind == "unavailable"


def test_multipart_roundtrip_of_calls_and_results():
    img = rgb()
    body, ctype = encode_multipart([("arguments", "application/json", b'{"image": "img_1"}'),
                                    ("img_1", "image/png", png_bytes(img))])
    assert ctype.startswith("multipart/form-data; boundary=osvl-")
    parts = decode_multipart(body, ctype)
    assert list(parts) == ["arguments", "img_1"] and parts["arguments"] == ("application/json", b'{"image": "img_1"}')
    assert parts["img_1"][0] == "image/png" and np.array_equal(image_from_bytes(parts["img_1"][1]), img)
    # what curl -F and requests write: quoted boundary, preamble, no part content type, an epilogue
    curl = (b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"arguments\"\r\n\r\n{}\r\n"
            b"--XyZ--\r\nepilogue")
    assert decode_multipart(curl, 'multipart/form-data; boundary="XyZ"') == {"arguments": ("text/plain", b"{}")}
    ok = ToolResult("ok", "Flipped.", {"img_2": rgb(), "img_3": rgb(seed=1)}, data={"boxes": [[1, 2]]})
    back = result_from_multipart(*result_to_multipart(ok))
    assert back.ok and back.text == "Flipped." and back.data == {"boxes": [[1, 2]]}
    assert all(np.array_equal(back.images[k], ok.images[k]) for k in ok.images)
    err = result_from_multipart(*result_to_multipart(ToolResult.fail("invalid_call", "too big", limit=True)))
    assert err.error.kind == "invalid_call" and err.error.limit


@pytest.mark.parametrize("body, ctype, why", [
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--b--", "application/json",
     "expected multipart/form-data"),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--b--", "multipart/form-data", "boundary"),
    (b"no delimiter anywhere", "multipart/form-data; boundary=b", "without its boundary"),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1", "multipart/form-data; boundary=b",
     "truncated"),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n1\r\n--b--", "multipart/form-data; boundary=b",
     "no blank line"),
    (b"--b\r\nContent-Type: text/plain\r\n\r\n1\r\n--b--", "multipart/form-data; boundary=b", "name="),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--b\r\n"
     b"Content-Disposition: form-data; name=\"a\"\r\n\r\n2\r\n--b--", "multipart/form-data; boundary=b",
     "appears twice"),
    (b"--b\r\nbroken header\r\n\r\n1\r\n--b--", "multipart/form-data; boundary=b", "malformed multipart header"),
])
def test_decode_multipart_rejects_malformed_bodies_with_a_typed_error(body, ctype, why):
    with pytest.raises(InvalidCall) as e:
        decode_multipart(body, ctype)
    assert why in str(e.value)


def test_multipart_names_that_would_break_the_header_are_refused():
    with pytest.raises(ValueError, match="part name"):
        encode_multipart([('img"\r\n', "image/png", b"")])
    garbled = result_from_multipart(b"--b\r\nContent-Disposition: form-data; name=\"result\"\r\n\r\n{}\r\n--b--",
                                    "multipart/form-data; boundary=b")
    assert garbled.error.kind == "unavailable"


def test_inprocess_transport_calls_validates_and_times_out():
    async def run():
        client = ToolClient(InProcessTransport(TOOLS), timeout_s=5.0)
        img = rgb()
        r = await client.call("flip", {"image": "img_1"}, {"img_1": img})
        assert r.ok and r.text == "Flipped img_1 as img_2." and np.array_equal(r.images["img_2"], img[:, ::-1])
        r = await client.call("flip", {"image": "img_1"}, {"img_1": img}, new_image_name="img_9")
        assert list(r.images) == ["img_9"]
        bad = [await client.call("flip", {"image": "img_7"}, {"img_1": img}),
               await client.call("flip", {"image": "img_1", "k": float("nan")}, {"img_1": img}),
               await client.call("flip", {"image": "img_1", "zoom": 2}, {"img_1": img}),
               await client.call("flip", ["img_1"], {"img_1": img}),
               await client.call("nope", {}, {})]
        assert [b.error.kind for b in bad] == ["invalid_call"] * 5
        assert "unknown tool 'nope'" in bad[-1].text
        fast = ToolClient(InProcessTransport(TOOLS), timeout_s=0.2)
        t = time.perf_counter()
        r = await fast.call("slow", {"seconds": 1.0})
        assert r.error.kind == "timeout" and time.perf_counter() - t < 0.8
        assert fast.stats == {"calls": 1, "attempts": 1, "retries": 0}  # timeouts are not retried
        assert [s["function"]["name"] for s in await client.schemas()] == ["flip", "slow"]

    asyncio.run(run())


def test_http_transport_maps_a_dead_server_to_unavailable_after_bounded_retries():
    async def run():
        client = ToolClient(HttpTransport(f"http://127.0.0.1:{free_port()}"), timeout_s=5.0, retries=2,
                            backoff_s=0.01)
        r = await client.call("flip", {"image": "img_1"}, {"img_1": rgb()})
        await client.close()
        return r, client.stats

    r, stats = asyncio.run(run())
    assert r.error.kind == "unavailable" and "img" not in r.text
    assert stats == {"calls": 1, "attempts": 3, "retries": 2}


def test_http_transport_refuses_what_it_cannot_send_without_a_request():
    async def run():
        client = ToolClient(HttpTransport(f"http://127.0.0.1:{free_port()}"), retries=2)
        out = [await client.call("flip", {"image": "img_1"}, {"img_1": rgb().astype(np.float32)}),
               await client.call("flip", {"image": object()}, {})]
        await client.close()
        return out, client.stats

    out, stats = asyncio.run(run())
    assert [r.error.kind for r in out] == ["invalid_call", "invalid_call"]
    assert stats["retries"] == 0  # nothing was sent, so nothing was retried


def test_make_client_checks_its_arguments():
    with pytest.raises(ValueError, match="url"):
        make_client("http")
    with pytest.raises(ValueError, match="unknown transport"):
        make_client("carrier-pigeon")
    with pytest.raises(ValueError):
        ToolClient(InProcessTransport(TOOLS), timeout_s=0)
    assert isinstance(make_client("inprocess", tools=TOOLS).transport, InProcessTransport)


def test_client_and_metrics_import_without_ray_and_metric_specs_are_checked():
    import subprocess
    import sys

    code = ("import sys, osvl.tools.client, osvl.metrics\n"
            "print(','.join(m for m in ('ray', 'torch', 'cv2', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    from osvl.metrics import SPECS, TOOL_REQUESTS, MetricSpec, prometheus_name

    assert prometheus_name(TOOL_REQUESTS) == "ray_osvl_tool_requests_total"
    assert all(name.startswith("osvl_") and spec.name == name for name, spec in SPECS.items())
    with pytest.raises(ValueError, match="start with 'osvl_'"):
        MetricSpec("tool_requests", "counter", "x")
    with pytest.raises(ValueError, match="bucket boundaries"):
        MetricSpec("osvl_x_seconds", "histogram", "x")
