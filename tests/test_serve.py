"""The tool API over real HTTP: one Serve app with every registered tool, shared by this module.

Every tool is called through ``osvl.tools.client`` (HTTP transport) on real photos and checked
against the same references the tool engineers use at function level; then a bad-input suite
sends malformed requests with a raw HTTP client and checks for typed 4xx answers, never a 5xx,
with the app still healthy afterwards. Handle calls (no HTTP) and auth are checked too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from test_client import bomb_png

from osvl.tools.client import HandleTransport, HttpTransport, ToolClient, encode_image, encode_multipart, png_bytes

pytestmark = pytest.mark.slow


def read_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def api(ray_cluster):
    """Base URL of a fresh Serve app with every registered tool (Serve shut down afterwards)."""
    from ray import serve

    from osvl.cluster import start_serve
    from serve.app import APP_NAME, build_app

    port = start_serve()
    serve.run(build_app({}), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def call(api: str, name: str, arguments, images=None, **kw):
    async def run():
        async with ToolClient(HttpTransport(api), timeout_s=120, **kw) as client:
            return await client.call(name, arguments, images or {})

    return asyncio.run(run())


def raw(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def body(arguments, images: dict[str, np.ndarray] | None = None) -> bytes:
    return json.dumps({"arguments": arguments,
                       "images": {k: encode_image(v) for k, v in (images or {}).items()}}).encode()


# ---------------------------------------------------------------------------
# the API surface


def test_health_tool_list_and_openapi(api):
    status, health = raw(f"{api}/healthz")
    assert status == 200 and health["status"] == "ok"
    status, listing = raw(f"{api}/v1/tools")
    names = [t["function"]["name"] for t in listing["tools"]]
    assert status == 200 and set(names) == set(health["tools"])
    assert set(names) == {"crop", "sharpen", "super_resolution", "perspective_correct", "ocr", "text_search",
                          "image_search"}
    for schema in listing["tools"]:
        assert schema["type"] == "function" and schema["function"]["parameters"]["type"] == "object"
    status, spec = raw(f"{api}/openapi.json")
    assert status == 200 and spec["info"]["title"] == "osvl tool API"
    post = spec["paths"]["/v1/tools/{name}"]["post"]
    assert {"200", "413", "415", "422", "503", "504"} <= set(post["responses"])
    assert "images" in post["requestBody"]["content"]["application/json"]["schema"]["properties"]
    for schema in listing["tools"]:  # one path per tool, its arguments the tool's own schema, a working example
        fn = schema["function"]
        body = spec["paths"][f"/v1/tools/{fn['name']}"]["post"]["requestBody"]["content"]
        assert body["application/json"]["schema"]["properties"]["arguments"]["properties"] == \
            fn["parameters"]["properties"]
        assert body["multipart/form-data"]["encoding"]["arguments"]["contentType"] == "application/json"
        example = body["application/json"]["example"]
        status, answer = raw(f"{api}/v1/tools/{fn['name']}", json.dumps(example).encode())
        assert status == 200 and answer["status"] == "ok", (fn["name"], answer)
    with urllib.request.urlopen(f"{api}/docs", timeout=30) as resp:
        assert b"/openapi.json" in resp.read()


# ---------------------------------------------------------------------------
# every tool on real photos


def test_crop_is_exact(api, shared_data):
    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")
    r = call(api, "crop", {"image": "img_1", "x": 101, "y": 37, "width": 123, "height": 77}, {"img_1": img})
    assert r.ok and r.text == "Cropped img_1 to 123x77 as img_2."
    assert np.array_equal(r.images["img_2"], img[37:114, 101:224])


def test_sharpen_matches_the_float64_scipy_reference(api, shared_data):
    from osvl.tools.sharpen import unsharp_reference

    img = read_rgb(shared_data / "images" / "opencv" / "text_defocus.jpg")
    r = call(api, "sharpen", {"image": "img_1", "amount": 1.5, "sigma": 2.0}, {"img_1": img})
    assert r.ok and r.images["img_2"].shape == img.shape
    ref = unsharp_reference(img, 1.5, 2.0)
    m = 3 * 4 * 2 + 1  # interior: one kernel radius in from each border
    diff = np.abs(r.images["img_2"].astype(int) - ref.astype(int))[m:-m, m:-m]
    assert diff.max() <= 1


def test_super_resolution_is_x4_and_beats_bicubic_on_every_set5_image(api, shared_data):
    from osvl.tools.super_resolution import bicubic_upscale, make_lr, modcrop, psnr_y

    rows = []
    for path in sorted((shared_data / "images" / "sr" / "Set5").glob("*.png")):
        hr = modcrop(read_rgb(path), 4)
        lr = make_lr(hr, 4)
        if lr.shape[0] * lr.shape[1] > 128 * 128:  # keep the CPU call short: the central LR window
            cy, cx = lr.shape[0] // 2 - 64, lr.shape[1] // 2 - 64
            lr, hr = lr[cy:cy + 128, cx:cx + 128], hr[4 * cy:4 * cy + 512, 4 * cx:4 * cx + 512]
        r = call(api, "super_resolution", {"image": "img_1"}, {"img_1": lr})
        assert r.ok, r.text
        sr = r.images["img_2"]
        assert sr.shape == (lr.shape[0] * 4, lr.shape[1] * 4, 3)
        rows.append((path.stem, psnr_y(sr, hr, 4), psnr_y(bicubic_upscale(lr, 4), hr, 4)))
    assert len(rows) == 5
    for name, edsr, bicubic in rows:
        assert edsr > bicubic, f"{name}: EDSR {edsr:.2f} dB <= bicubic {bicubic:.2f} dB ({rows})"


def test_perspective_correct_finds_the_warped_document_corners(api):
    from test_image_tools import _document, _photographed

    corners = [[150, 100], [620, 160], [700, 720], [90, 650]]
    img = _photographed(_document(), corners)
    r = call(api, "perspective_correct", {"image": "img_1"}, {"img_1": img})
    assert r.ok and "img_2" in r.images, r.text
    err = np.hypot(*(np.array(r.data["corners"]) - np.array(corners, float)).T)
    assert err.max() <= 0.01 * math.hypot(*img.shape[:2]), err


def test_ocr_reads_a_rendered_sentence_and_a_real_page(api, shared_data):
    from test_image_tools import IMAGE_TEXT_N, SENTENCE, _rendered_sentence

    from osvl.tools.ocr import char_error_rate, word_recall

    r = call(api, "ocr", {"image": "img_1"}, {"img_1": _rendered_sentence()})
    assert r.ok and char_error_rate(r.data["text"], SENTENCE) <= 0.10, r.data
    page = read_rgb(shared_data / "images" / "opencv" / "imageTextN.png")
    r = call(api, "ocr", {"image": "img_1"}, {"img_1": page})
    assert r.ok and word_recall(r.data["text"], IMAGE_TEXT_N) >= 0.8, r.data["text"]


def test_text_search_answers(api):
    r = call(api, "text_search", {"query": "lattice tower on the Champ de Mars in Paris", "top_k": 3})
    assert r.ok and r.text.startswith('Search results for "lattice tower'), r.text
    assert "Eiffel Tower" in r.text.splitlines()[1]


def test_image_search_answers_with_a_crop_of_a_known_photo(api, shared_data):
    manifest = json.loads((shared_data / "images" / "gcompris" / "manifest.json").read_text())
    colosseum = next(m for m in manifest if m["name"] == "Colosseum")
    img = read_rgb(shared_data / "images" / "gcompris" / colosseum["image"])
    h, w = img.shape[:2]
    r = call(api, "image_search", {"image": "img_1", "top_k": 3}, {"img_1": img[h // 10:h - h // 10, w // 10:]})
    assert r.ok and r.data["hits"], r.text
    assert "Colosseum" in r.text.splitlines()[1], r.text


def test_json_and_multipart_calls_give_the_same_result(api, shared_data):
    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:200, :300]

    async def run():
        out = []
        for binary in (True, False):
            async with ToolClient(HttpTransport(api, binary=binary), timeout_s=120) as client:
                out.append(await client.call("sharpen", {"image": "img_1"}, {"img_1": img, "img_2": img[:10]},
                                             new_image_name="img_7"))
        return out

    multipart, plain = asyncio.run(run())
    assert multipart.ok and plain.ok and list(multipart.images) == list(plain.images) == ["img_7"]
    assert multipart.text == plain.text and np.array_equal(multipart.images["img_7"], plain.images["img_7"])
    assert multipart.images["img_7"].shape == img.shape


def test_handle_transport_gives_the_same_result_without_http(api, shared_data):
    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:200, :300]

    async def run():
        client = ToolClient(HandleTransport(), timeout_s=60)
        return (await client.call("sharpen", {"image": "img_1"}, {"img_1": img}),
                await client.call("crop", {"image": "img_1", "x": 0, "y": 0, "width": 999, "height": 1},
                                  {"img_1": img}),
                await client.call("no_such_tool", {}, {}),
                await client.schemas(),
                # concurrent calls travel as one Serve request: each must get its own answer back
                await asyncio.gather(*[client.call("crop", {"image": "img_1", "x": i, "y": i, "width": 5 + i,
                                                            "height": 5}, {"img_1": img}) for i in range(6)]))

    ok, oob, unknown, schemas, crops = asyncio.run(run())
    for i, r in enumerate(crops):
        assert r.ok and np.array_equal(r.images["img_2"], img[i:i + 5, i:2 * i + 5])
    assert ok.ok and np.array_equal(ok.images["img_2"], call(api, "sharpen", {"image": "img_1"},
                                                             {"img_1": img}).images["img_2"])
    assert oob.error.kind == "invalid_call" and "out of bounds" in oob.text
    assert unknown.error.kind == "invalid_call"
    assert {s["function"]["name"] for s in schemas} >= {"crop", "sharpen"}


def test_a_replica_resolves_each_image_ref_once_within_its_byte_budget(ray_cluster, monkeypatch):
    """Handle callers resend one image ref per call; the replica keeps recent ones, bounded in bytes."""
    import ray

    import serve.app as app
    from osvl.tools.registry import all_tools

    monkeypatch.setattr(app, "REF_CACHE_BYTES", 3 * 64 * 64 * 3)  # room for three 64x64 images
    replica = app._ToolReplica(all_tools()["crop"], {})
    imgs = [np.full((64, 64, 3), i, np.uint8) for i in range(5)]
    refs = [ray.put(a) for a in imgs]

    async def resolve(i: int) -> np.ndarray:
        return (await replica._resolve({"img_1": refs[i], "raw": imgs[i]}))["img_1"]

    for i in (0, 1, 0, 2, 3, 4):
        assert np.array_equal(asyncio.run(resolve(i)), imgs[i])
    assert replica._array_bytes <= app.REF_CACHE_BYTES
    assert list(replica._arrays) == [refs[i].binary() for i in (2, 3, 4)]  # least recently used went first
    assert asyncio.run(replica._resolve({"img_1": imgs[0]}))["img_1"] is imgs[0]  # arrays pass through


# ---------------------------------------------------------------------------
# bad input: typed 4xx, never a 5xx, the app stays healthy


def _bad_requests(shared_data: Path) -> list[tuple[str, str, bytes, int] | tuple[str, str, bytes, int, str]]:
    """(why, tool, body, expected status[, Content-Type]); the Content-Type is JSON unless given."""
    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:64, :96]
    good = encode_image(img)
    crop = {"image": "img_1", "x": 0, "y": 0, "width": 10, "height": 10}
    big_png = base64.b64encode(bomb_png(20_000, 20_000)).decode()
    args = ("arguments", "application/json", json.dumps(crop).encode())
    png = ("img_1", "image/png", png_bytes(img))
    whole, whole_type = encode_multipart([args, png])
    multipart = [
        ("multipart: garbage body", b"\x00garbage\xff" * 100, whole_type, 422),
        ("multipart: no boundary parameter", whole, "multipart/form-data", 422),
        ("multipart: truncated", whole[:len(whole) // 2], whole_type, 422),
        ("multipart: no arguments part", *encode_multipart([png]), 422),
        ("multipart: arguments not JSON", *encode_multipart([("arguments", "application/json", b"{x"), png]), 422),
        ("multipart: arguments a list", *encode_multipart([("arguments", "application/json", b"[1]"), png]), 422),
        ("multipart: image part of type text", *encode_multipart([args, ("img_1", "text/plain", b"hello")]), 422),
        ("multipart: image part not an image", *encode_multipart([args, ("img_1", "image/png", b"%PDF-1.4")]), 422),
        ("multipart: image part missing", *encode_multipart([args]), 422),
        ("multipart: 20000x20000 PNG part",
         *encode_multipart([args, ("img_1", "image/png", bomb_png(20_000, 20_000))]), 413),
        ("multipart: duplicate part", *encode_multipart([args, args, png]), 422),
        ("multipart: part without a name", whole.replace(b'form-data; name="img_1"', b"form-data"), whole_type, 422),
        ("multipart: header line without a colon", whole.replace(b"Content-Type: image/png", b"Content-Type image/png"),
         whole_type, 422),
        ("multipart: new_image_name not UTF-8",
         *encode_multipart([args, ("new_image_name", "text/plain", b"\xff\xfe"), png]), 422),
        ("wrong content type: text/plain", json.dumps({"arguments": crop}).encode(), "text/plain", 415),
        ("wrong content type: a raw PNG", png[2], "image/png", 415),
        ("wrong content type: none", json.dumps({"arguments": crop}).encode(), "", 415),
    ]
    # crop is run by the ingress itself (ServeConfig.inline), ocr is forwarded to its batched replica:
    # both paths parse and refuse the same way
    return [(why + f" ({tool})", tool, data, expected, ctype) for why, data, ctype, expected in multipart
            for tool in ("crop", "ocr")] + [
        ("invalid base64", "crop", json.dumps({"arguments": crop, "images": {"img_1": "@@not base64@@"}}).encode(),
         422),
        ("non-image bytes", "crop", json.dumps({"arguments": crop, "images": {
            "img_1": base64.b64encode(b"%PDF-1.4 definitely not a picture").decode()}}).encode(), 422),
        ("empty body", "crop", b"", 422),
        ("not JSON", "crop", b"{\"arguments\": ", 422),
        ("body is a list", "crop", b"[1, 2]", 422),
        ("20000x20000 PNG", "crop", json.dumps({"arguments": crop, "images": {"img_1": big_png}}).encode(), 413),
        ("crop out of bounds", "crop", body({**crop, "x": 90}, {"img_1": img}), 422),
        ("negative width", "crop", body({**crop, "width": -5}, {"img_1": img}), 422),
        ("NaN argument", "crop", json.dumps({"arguments": {**crop, "x": math.nan}, "images": {"img_1": good}}
                                            ).encode(), 422),  # Python's json writes NaN, as sloppy clients do
        ("NaN sigma", "sharpen", body({"image": "img_1", "sigma": "NaN"}, {"img_1": img}), 422),
        ("negative amount", "sharpen", body({"image": "img_1", "amount": -1}, {"img_1": img}), 422),
        ("string for int", "crop", body({**crop, "x": "10"}, {"img_1": img}), 422),
        ("bool for int", "crop", body({**crop, "x": True}, {"img_1": img}), 422),
        ("arguments is a list", "crop", json.dumps({"arguments": [1], "images": {}}).encode(), 422),
        ("images is a list", "crop", json.dumps({"arguments": crop, "images": [good]}).encode(), 422),
        ("image is a number", "crop", json.dumps({"arguments": crop, "images": {"img_1": 7}}).encode(), 422),
        ("unknown image ref", "crop", body({**crop, "image": "img_5"}, {"img_1": img}), 422),
        ("unknown argument", "crop", body({**crop, "zoom": 2}, {"img_1": img}), 422),
        ("missing argument", "crop", body({"image": "img_1"}, {"img_1": img}), 422),
        ("unknown body field", "crop", json.dumps({"arguments": crop, "imgs": {}}).encode(), 422),
        ("unknown tool", "no_such_tool", body({}), 422),
        ("oversized body", "crop", b"{\"arguments\": {}, \"pad\": \"" + b"x" * (33 * 2**20) + b"\"}", 413),
    ]


def test_bad_input_gets_typed_4xx_and_the_app_stays_healthy(api, shared_data):
    failures = []
    for why, tool, data, expected, *ctype in _bad_requests(shared_data):
        status, answer = raw(f"{api}/v1/tools/{tool}", data, {"Content-Type": ctype[0]} if ctype else None)
        ok = (status == expected and answer["status"] == "error" and answer["error"]["kind"] == "invalid_call"
              and answer["text"].startswith("Error (invalid_call): "))
        if not ok:
            failures.append((why, status, str(answer)[:200]))
    assert not failures, failures
    assert raw(f"{api}/healthz") == (200, {"status": "ok", "tools": raw(f"{api}/healthz")[1]["tools"]})
    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:64, :96]
    assert call(api, "crop", {"image": "img_1", "x": 0, "y": 0, "width": 8, "height": 8}, {"img_1": img}).ok


def test_auth_token_is_required_when_configured(ray_cluster, api, shared_data, monkeypatch):
    from ray import serve

    from serve.app import build_app

    monkeypatch.setenv("OSVL_TEST_TOKEN", "s3cret-token")
    serve.run(build_app({"tools": ["crop"], "token_env": "OSVL_TEST_TOKEN"}), name="osvl_tools_auth",
              route_prefix="/auth")
    try:
        img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:32, :32]
        data = body({"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4}, {"img_1": img})
        url = f"{api}/auth/v1/tools/crop"
        assert raw(url, data)[0] == 401
        assert raw(url, data, {"Authorization": "Bearer wrong"})[0] == 401
        assert raw(f"{api}/auth/v1/tools", None)[0] == 401
        status, answer = raw(url, data, {"Authorization": "Bearer s3cret-token"})
        assert status == 200 and answer["status"] == "ok"
        assert raw(f"{api}/auth/healthz")[0] == 200  # liveness probes carry no token
    finally:
        serve.delete("osvl_tools_auth")


@pytest.mark.parametrize("inline", [["sharpen"], []], ids=["inline", "forwarded"])
def test_a_call_past_the_deadline_is_a_504_timeout(ray_cluster, api, inline):
    from ray import serve

    from serve.app import build_app

    serve.run(build_app({"tools": ["sharpen"], "timeout_s": 0.05, "inline": inline}), name="osvl_tools_deadline",
              route_prefix="/deadline")
    try:
        img = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
        status, answer = raw(f"{api}/deadline/v1/tools/sharpen", body({"image": "img_1", "sigma": 50}, {"img_1": img}))
        assert status == 504 and answer["error"]["kind"] == "timeout", answer
        r = call(f"{api}/deadline", "sharpen", {"image": "img_1", "sigma": 50}, {"img_1": img}, retries=2)
        assert r.error.kind == "timeout"
    finally:
        serve.delete("osvl_tools_deadline")


def test_metrics_are_exported_by_ray(api, shared_data):
    """The replicas' osvl_* series reach Ray's Prometheus endpoint on this node."""
    import time

    import ray

    from osvl import metrics

    img = read_rgb(shared_data / "images" / "opencv" / "messi5.jpg")[:64, :64]
    assert call(api, "crop", {"image": "img_1", "x": 0, "y": 0, "width": 8, "height": 8}, {"img_1": img}).ok
    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = [metrics.prometheus_name(metrics.TOOL_REQUESTS), metrics.prometheus_name(metrics.TOOL_LATENCY)]
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        if all(w in text for w in wanted):
            break
        time.sleep(2)
    lines = [ln for ln in text.splitlines() if ln.startswith(wanted[0] + "{")]
    assert any('tool="crop"' in ln and 'status="ok"' in ln for ln in lines), lines[:5]
    assert wanted[1] + "_bucket" in text


KEEP_FREED_PROBE = """
import json, resource, threading
import numpy as np
from osvl.tools.sharpen import unsharp
from serve.app import keep_freed_memory

img = np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)

def faults_per_call(calls=64, threads=4):
    def work():
        for _ in range(calls // threads):
            unsharp(img)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pool = [threading.Thread(target=work) for _ in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls

faults_per_call(8)  # imports and first allocations
default = faults_per_call()
took = keep_freed_memory()
faults_per_call(8)  # the first calls after the switch fill the heap
print(json.dumps({"took": took, "default": default, "kept": faults_per_call()}))
"""


def test_tool_replicas_keep_freed_image_buffers_instead_of_faulting_them_in_again():
    """Why tool replicas call ``keep_freed_memory``: with glibc's defaults, threads running an image
    tool get each temporary buffer as fresh mapped pages (zeroed by the kernel); kept, the pages are
    reused. Minor page faults count that directly, with no timing."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", KEEP_FREED_PROBE], cwd=root, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["took"] is True
    assert got["default"] > 50, got  # 512x512x3 float32 temporaries are 768 pages each
    assert got["kept"] < got["default"] / 5, got
