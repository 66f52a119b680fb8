"""Tool throughput: in-process, Serve deployment handles, HTTP, and a plain Serve app over HTTP.

    python bench/tools.py [--seconds=3] [--concurrency=8] [--replicas=2] [--tools=crop,sharpen,...]
                          [--inline=crop,sharpen,perspective_correct]

Every image tool runs on a 512x512 image (EDSR on 128x128 and 256x256 inputs) with the same
number of concurrent clients on each transport; each cell is completed calls per second over
``--seconds`` after one warm-up call. Transports: ``inprocess`` (the tool function in a thread),
``handle`` (the tool's Serve deployment through a handle), ``http`` (the osvl tool API with the
Python client's default, multipart; the ``--inline`` tools run in the ingress, the others are
forwarded to their tool deployment, see ``ServeConfig.inline``; ``--inline=`` forwards every
call), ``http_json`` (the same API, base64 JSON) and ``plain``,
the baseline: a plain one-deployment Serve app (``PlainToolApp``, below: the request a base64
PNG in JSON, decoded, the registered tool run, the reply encoded the same way, with osvl's own
PNG codec) with as many replicas as each tool deployment, called over HTTP with base64 JSON.
Then EDSR at 16 concurrent clients against a batched (``@serve.batch`` + one forward pass per
batch) and an unbatched deployment with the same replica count.

The last line is one JSON object: ``ratio`` is osvl's HTTP throughput over the plain Serve
app's for sharpen at 512x512 (what osvl's API costs over the simplest app doing the same work;
higher is better), ``handle_over_inprocess`` the handle throughput over in-process for sharpen
(what a rollout actor pays for running tools in Serve), and ``ratios`` both figures per tool.

The bench's Ray cluster runs its workers at the bench's own priority (``RAY_worker_niceness=0``; Ray's
default is 15), so that the replicas and the in-process baseline compete for the cores on equal terms.

Images are synthetic or from scikit-image's bundled photos, so the benchmark needs no shared data.
When the committed EDSR weights are missing, a freshly initialised model of the same
architecture is used (throughput does not depend on the weight values).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont
from ray import serve
from skimage import data as skimage_data
from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.agent.env import search_backends  # noqa: E402
from osvl.cluster import init_ray, start_serve  # noqa: E402
from osvl.tools.base import ToolContext, call_tool  # noqa: E402
from osvl.tools.client import (  # noqa: E402
    HandleTransport,
    HttpTransport,
    InProcessTransport,
    ToolClient,
    decode_image,
    result_to_wire,
)
from osvl.tools.image_search import ImageSearchConfig  # noqa: E402
from osvl.tools.registry import all_tools  # noqa: E402
from osvl.tools.super_resolution import DEFAULT_WEIGHTS, build_model, save_checkpoint  # noqa: E402
from osvl.tools.text_search import TextSearchConfig  # noqa: E402
from serve.app import BackendOptions, ServeConfig, make_app  # noqa: E402

if TYPE_CHECKING:
    from serve.app import BackendOptions


def plain_tool_app(tools: dict[str, Any], options: dict[str, Any], replicas: int) -> Any:
    """The baseline: the simplest Serve app doing the same work, one deployment for every tool.

    ``POST .../<tool>`` with ``{"arguments": ..., "images": {name: base64 PNG}}``; the reply is the
    tool result with new images as base64 PNG (the shape osvl's JSON client reads).
    """
    @serve.deployment(num_replicas=replicas, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0.1})
    class PlainToolApp:
        def __init__(self, tools: dict[str, Any], options: dict[str, Any]) -> None:
            self.tools, self.options = tools, options

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            tool = self.tools[request.url.path.rsplit("/", 1)[-1]]

            def work() -> dict[str, Any]:
                images = {k: decode_image(v) for k, v in body.get("images", {}).items()}
                return result_to_wire(call_tool(tool, body["arguments"], ToolContext(images, options=self.options)))

            return await asyncio.to_thread(work)

    return PlainToolApp.bind(tools, options)


def astronaut() -> np.ndarray:
    return np.ascontiguousarray(skimage_data.astronaut())  # 512x512 RGB photo bundled with scikit-image


def page(size: int = 512) -> np.ndarray:
    """A rendered text page photographed at an angle (for OCR and perspective correction)."""
    im = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(im)
    font = ImageFont.load_default(size=20)
    for i in range(12):
        d.text((24, 24 + 38 * i), f"Line {i}: the tool API benchmark page", fill="black", font=font)
    doc = np.asarray(im)
    src = np.float32([[0, 0], [size, 0], [size, size], [0, size]])
    dst = np.float32([[60, 40], [480, 70], [500, 490], [30, 460]])
    warped = cv2.warpPerspective(doc, cv2.getPerspectiveTransform(src, dst), (size, size))
    mask = cv2.warpPerspective(np.full((size, size), 255, np.uint8), cv2.getPerspectiveTransform(src, dst),
                               (size, size)) > 127
    out = np.full_like(doc, 60)
    out[mask] = warped[mask]
    return out


def cases() -> list[tuple[str, str, dict[str, Any], np.ndarray]]:
    """(label, tool, arguments, image) rows of the main table."""
    photo, doc = astronaut(), page()
    return [
        ("crop 512", "crop", {"image": "img_1", "x": 128, "y": 128, "width": 256, "height": 256}, photo),
        ("sharpen 512", "sharpen", {"image": "img_1"}, photo),
        ("perspective_correct 512", "perspective_correct", {"image": "img_1"}, doc),
        ("ocr 512", "ocr", {"image": "img_1"}, doc),
        ("super_resolution 128", "super_resolution", {"image": "img_1"}, photo[::4, ::4].copy()),
        ("super_resolution 256", "super_resolution", {"image": "img_1"}, photo[::2, ::2].copy()),
    ]


async def throughput(client: ToolClient, tool: str, args: dict, img: np.ndarray, concurrency: int,
                     seconds: float) -> tuple[float, int]:
    """Completed calls per second with ``concurrency`` callers; also returns the number of failed calls."""
    first = await client.call(tool, args, {"img_1": img})  # warm-up: model loads, connections
    if not first.ok:
        raise RuntimeError(f"{tool}: {first.text}")
    done, failed = 0, 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, failed
        while time.perf_counter() < deadline:
            r = await client.call(tool, args, {"img_1": img})
            done += 1
            failed += not r.ok

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return done / (time.perf_counter() - start), failed


def edsr_options() -> BackendOptions:
    if DEFAULT_WEIGHTS.is_file():
        return BackendOptions()
    path = Path(tempfile.mkdtemp()) / "edsr_x4_random.pth"
    save_checkpoint(build_model(), path)
    print(f"# {DEFAULT_WEIGHTS} missing: using a fresh model of the same architecture", flush=True)
    return BackendOptions(edsr_weights=str(path))


def main(argv: list[str]) -> dict[str, Any]:
    opts = {"seconds": 3.0, "concurrency": 8, "replicas": 2, "tools": "", "inline": ",".join(ServeConfig().inline)}
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option --{key}; options: {sorted(opts)}")
        opts[key] = type(opts[key])(value)

    tools = all_tools()
    rows = [c for c in cases() if c[1] in tools and (not opts["tools"] or c[1] in opts["tools"].split(","))]
    names = sorted({c[1] for c in rows})
    backend = edsr_options() if "super_resolution" in names else BackendOptions()
    # the in-process and plain baselines get what the app's replicas hand their tools: the same backends
    options = {**search_backends(TextSearchConfig(), ImageSearchConfig()), **backend.as_options()}

    # Ray starts its workers at niceness 15 (so that its own daemons stay responsive), the in-process
    # baseline runs here at the caller's: equal priority, or any other load on the machine takes CPU from
    # the replicas first and the handle/in-process ratio measures the scheduler
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_ray(include_dashboard=False)
    port = start_serve()
    fixed = {"num_replicas": opts["replicas"], "autoscaling_config": None}
    deployments = {"api": fixed, **{"tool_" + n: fixed for n in names}}
    inline = [n for n in opts["inline"].split(",") if n in names]
    serve.run(make_app(tools, ServeConfig(tools=names, options=backend, inline=inline), deployments),
              name="osvl_bench", route_prefix="/")
    serve.run(plain_tool_app({n: tools[n] for n in names}, options, opts["replicas"]), name="plain_bench",
              route_prefix="/plain")
    url = f"http://127.0.0.1:{port}"
    clients = {
        "inprocess": ToolClient(InProcessTransport(tools, options=options), timeout_s=300),
        "handle": ToolClient(HandleTransport("osvl_bench"), timeout_s=300),
        "http": ToolClient(HttpTransport(url), timeout_s=300),
        "http_json": ToolClient(HttpTransport(url, binary=False), timeout_s=300),
        "plain": ToolClient(HttpTransport(url + "/plain", binary=False), timeout_s=300),
    }
    table: dict[str, dict[str, float]] = {}
    failures = 0

    async def run_table() -> None:
        nonlocal failures
        for label, tool, args, img in rows:
            table[label] = {}
            for transport, client in clients.items():
                rate, failed = await throughput(client, tool, args, img, opts["concurrency"], opts["seconds"])
                table[label][transport] = round(rate, 2)
                failures += failed
            print(f"{label:26s} " + "  ".join(f"{t} {v:7.2f}/s" for t, v in table[label].items()), flush=True)
        for client in clients.values():
            await client.close()

    asyncio.run(run_table())
    batching: dict[str, float] = {}
    if "super_resolution" in names:
        serve.run(make_app(tools, ServeConfig(tools=["super_resolution"], batched=[], options=backend),
                           {"api": fixed, "tool_super_resolution": fixed}), name="osvl_bench_unbatched",
                  route_prefix="/unbatched")
        img = astronaut()[::4, ::4].copy()

        async def run_batching() -> None:
            nonlocal failures
            for label, app in (("batched", "osvl_bench"), ("unbatched", "osvl_bench_unbatched")):
                client = ToolClient(HandleTransport(app), timeout_s=300)
                rate, failed = await throughput(client, "super_resolution", {"image": "img_1"}, img, 16,
                                                2 * opts["seconds"])
                batching[label] = round(rate, 2)
                failures += failed

        asyncio.run(run_batching())
        print(f"EDSR 128 at 16 clients (handles): batched {batching['batched']}/s, "
              f"unbatched {batching['unbatched']}/s", flush=True)
    serve.shutdown()
    ratios = {label: {"http_over_plain": round(row["http"] / row["plain"], 3),
                      "handle_over_inprocess": round(row["handle"] / row["inprocess"], 3)}
              for label, row in table.items()}
    sharpen = ratios.get("sharpen 512", {})
    result = {
        "ratio": sharpen.get("http_over_plain"),
        "baseline": "a plain one-deployment Serve app doing the same tool work over HTTP (base64 PNG JSON), "
                    "same replicas, same client concurrency",
        "handle_over_inprocess": sharpen.get("handle_over_inprocess"),
        "concurrency": opts["concurrency"], "replicas": opts["replicas"], "seconds": opts["seconds"],
        "inline": inline,
        "calls_per_s": table, "ratios": ratios, "edsr_16_clients": batching,
        "edsr_batched_over_unbatched": round(batching["batched"] / batching["unbatched"], 3) if batching else None,
        "failed_calls": failures,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
