"""Record/replay cache around call_tool: keys, the four modes, image-name independence, concurrent writers."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

import osvl.tools.crop  # noqa: F401 - registers crop
import osvl.tools.text_search  # noqa: F401 - registers text_search
from osvl.errors import ConfigError, ToolCallError
from osvl.tools.base import REGISTRY, TextHit, ToolContext
from osvl.tools.cache import ToolCache, image_digest


class CountingBackend:
    """A text_search backend that answers from a fixed table and counts how often it is asked.

    The cache's whole point is *not* calling the backend, so the test needs a backend whose
    calls it can count; answers are fixed so record and replay can be compared exactly.
    """

    def __init__(self, backend_id: str = "table-v1", fail: ToolCallError | None = None) -> None:
        self.backend_id = backend_id
        self.calls = 0
        self.fail = fail

    def search(self, query: str, top_k: int) -> list[TextHit]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return [TextHit(f"{query.title()} {i}", f"passage {i} about {query}", 1.0 / (i + 1)) for i in range(top_k)]


def _photo(seed: int = 0, shape=(60, 80, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_modes_record_replay_strict(tmp_path):
    backend = CountingBackend()
    ctx = ToolContext(images={}, options={"text_search": backend})
    tool = REGISTRY["text_search"]
    args = {"query": "eiffel tower", "top_k": 2}

    off = ToolCache(tmp_path, "off")
    assert off.call(tool, args, ctx).ok and backend.calls == 1
    assert not any(tmp_path.rglob("*.npz")), "off mode wrote a recording"

    strict = ToolCache(tmp_path, "strict-replay")
    miss = strict.call(tool, args, ctx)
    assert miss.error.kind == "unavailable" and "no recording" in miss.error.message and backend.calls == 1

    replay = ToolCache(tmp_path, "replay")
    first = replay.call(tool, args, ctx)  # miss: calls and records
    assert backend.calls == 2 and len(list(tmp_path.rglob("*.npz"))) == 1
    again = replay.call(tool, dict(reversed(list(args.items()))), ctx)  # argument order is not in the key
    assert backend.calls == 2 and (replay.hits, replay.misses) == (1, 1)
    assert again.text == first.text and again.data == first.data and again.status == "ok"
    assert strict.call(tool, args, ctx).text == first.text and backend.calls == 2

    record = ToolCache(tmp_path, "record")  # always calls, overwrites
    record.call(tool, args, ctx)
    assert backend.calls == 3 and len(list(tmp_path.rglob("*.npz"))) == 1


def test_key_covers_arguments_backend_and_version(tmp_path):
    tool = REGISTRY["text_search"]
    cache = ToolCache(tmp_path, "replay")
    a = ToolContext(images={}, options={"text_search": CountingBackend("table-v1")})
    b = ToolContext(images={}, options={"text_search": CountingBackend("table-v2")})
    k1, _ = cache.key(tool, {"query": "x"}, a)
    assert cache.key(tool, {"query": "x"}, b)[0] != k1  # another index or search engine
    assert cache.key(tool, {"query": "y"}, a)[0] != k1
    assert cache.key(tool, {"query": "x", "top_k": 5}, a)[0] != k1  # explicit default is another call
    from dataclasses import replace

    assert cache.key(replace(tool, version=tool.version + ".next"), {"query": "x"}, a)[0] != k1
    assert cache.key(replace(tool, backend="other"), {"query": "x"}, a)[0] != k1


def test_replay_renames_images_by_content(tmp_path):
    crop = REGISTRY["crop"]
    cache = ToolCache(tmp_path, "replay")
    photo = _photo()
    rec = cache.call(crop, {"image": "img_1", "x": 10, "y": 5, "width": 30, "height": 20},
                     ToolContext(images={"img_1": photo}))
    assert rec.text == "Cropped img_1 to 30x20 as img_2." and list(rec.images) == ["img_2"]
    # same pixels under another name in a longer episode: a hit, with this episode's names
    ctx = ToolContext(images={"img_1": _photo(1), "img_2": _photo(2), "img_3": photo.copy(), "img_4": _photo(4)})
    strict = ToolCache(tmp_path, "strict-replay")
    out = strict.call(crop, {"image": "img_3", "x": 10, "y": 5, "width": 30, "height": 20}, ctx)
    assert out.ok and out.text == "Cropped img_3 to 30x20 as img_5." and list(out.images) == ["img_5"]
    np.testing.assert_array_equal(out.images["img_5"], photo[5:25, 10:40])
    # other pixels under the recorded name: a miss
    other = strict.call(crop, {"image": "img_1", "x": 10, "y": 5, "width": 30, "height": 20}, ctx)
    assert other.error.kind == "unavailable"


def test_errors_deterministic_recorded_transient_not(tmp_path):
    crop, search = REGISTRY["crop"], REGISTRY["text_search"]
    cache = ToolCache(tmp_path, "replay")
    ctx = ToolContext(images={"img_1": _photo()})
    bad = cache.call(crop, {"image": "img_1", "x": 70, "y": 0, "width": 30, "height": 20}, ctx)
    assert bad.error.kind == "invalid_call"
    replayed = ToolCache(tmp_path, "strict-replay").call(
        crop, {"image": "img_1", "x": 70, "y": 0, "width": 30, "height": 20}, ctx)
    assert replayed.error.kind == "invalid_call" and replayed.text == bad.text and "img_1" in replayed.text
    down = CountingBackend(fail=ToolCallError("unavailable", "search API down"))
    sctx = ToolContext(images={}, options={"text_search": down})
    assert cache.call(search, {"query": "q"}, sctx).error.kind == "unavailable"
    assert cache.call(search, {"query": "q"}, sctx).error.kind == "unavailable" and down.calls == 2


def test_bad_mode_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="strict-replay"):
        ToolCache(tmp_path, "replay-strict")


def _writer(root: str, worker: int, out: mp.Queue) -> None:
    crop = REGISTRY["crop"]
    cache = ToolCache(root, "record")
    photo = _photo(7, (64, 64, 3))
    for i in range(25):
        x = (i + worker) % 10  # keys overlap across workers: same key written by several at once
        cache.call(crop, {"image": "img_1", "x": x, "y": 0, "width": 32, "height": 32},
                   ToolContext(images={"img_1": photo}))
    out.put(worker)


def test_concurrent_writers_leave_only_whole_recordings(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, q)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(q.get(timeout=5) for _ in procs) == [0, 1, 2, 3]
    files = list(Path(tmp_path).rglob("*.npz"))
    assert len(files) == 10 and not list(Path(tmp_path).rglob(".tmp-*"))
    photo = _photo(7, (64, 64, 3))
    strict = ToolCache(tmp_path, "strict-replay")
    for x in range(10):
        res = strict.call(REGISTRY["crop"], {"image": "img_1", "x": x, "y": 0, "width": 32, "height": 32},
                          ToolContext(images={"img_1": photo}))
        assert res.ok, res.text
        np.testing.assert_array_equal(res.images["img_2"], photo[:32, x:x + 32])


def test_image_digest_sees_shape_and_pixels():
    a = _photo()
    assert image_digest(a) == image_digest(a.copy())
    assert image_digest(a) != image_digest(a.reshape(80, 60, 3))
    b = a.copy()
    b[0, 0, 0] ^= 1
    assert image_digest(a) != image_digest(b)


def test_key_of_an_env_backend_follows_its_config_without_building_it(tmp_path):
    from osvl.agent.env import search_backends
    from osvl.tools import text_search as ts
    from osvl.tools.image_search import ImageSearchConfig

    tool = REGISTRY["text_search"]
    cache = ToolCache(tmp_path, "replay")

    def key(cfg: ts.TextSearchConfig) -> str:
        backend = search_backends(cfg, ImageSearchConfig())["text_search"]
        return cache.key(tool, {"query": "x"}, ToolContext(images={}, options={"text_search": backend}))[0]

    offline = key(ts.TextSearchConfig())
    assert offline != key(ts.TextSearchConfig(backend="web")) and key(ts.TextSearchConfig()) == offline
