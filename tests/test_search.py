"""Offline search tools: reverse image search (ORB + RANSAC) and text search (BM25 + dense re-rank).

The acceptance figures are computed on the real shared photos and texts with seeded
degradations and seeded entity picks, and printed so the report can quote them.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from osvl.errors import ConfigError
from osvl.tools.base import REGISTRY, ToolContext, call_tool
from osvl.tools.image_search import ImageIndex, ImageSearchConfig, build_image_index
from osvl.tools.image_search import image_search as image_search_fn
from osvl.tools.text_search import TextIndex, TextSearchConfig, build_text_index

SKIMAGE_PHOTOS = ("astronaut", "rocket", "coffee", "chelsea", "camera", "page", "text")


def _load_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def photo_items(shared: Path) -> list[tuple[np.ndarray, str, str, str]]:
    """Every gcompris photo of both manifests and the skimage photos, as (image, name, snippet, file)."""
    import skimage.data

    root = shared / "images" / "gcompris"
    items = []
    for e in json.loads((root / "manifest.json").read_text()):
        items.append((_load_rgb(root / e["image"]), e["name"], e["caption"][:120], e["image"]))
    for e in json.loads((root / "categorization" / "manifest.json").read_text()):
        items.append((_load_rgb(root / e["image"]), e["name_from_filename"], e["collection"], e["image"]))
    for name in SKIMAGE_PHOTOS:
        arr = getattr(skimage.data, name)()
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, axis=-1)
        items.append((np.ascontiguousarray(arr[..., :3]), name.title(), "scikit-image sample photo", name))
    return items


def degrade(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Crop keeping 50-90 % of the area, Gaussian blur sigma <= 2, scale 0.3-1.0, JPEG quality 40-90."""
    import cv2
    from PIL import Image

    h, w = img.shape[:2]
    area = rng.uniform(0.5, 0.9)
    aspect = rng.uniform(0.75, 1.33)
    cw = min(w, max(1, round(w * np.sqrt(area * aspect))))
    ch = min(h, max(1, round(area * h * w / cw)))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    out = img[y:y + ch, x:x + cw]
    sigma = rng.uniform(0.0, 2.0)
    if sigma > 0.05:
        out = cv2.GaussianBlur(out, (0, 0), sigma)
    s = rng.uniform(0.3, 1.0)
    out = cv2.resize(out, (max(1, round(out.shape[1] * s)), max(1, round(out.shape[0] * s))),
                     interpolation=cv2.INTER_AREA)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(out)).save(buf, "JPEG", quality=int(rng.integers(40, 91)))
    return np.asarray(Image.open(buf).convert("RGB"))


@pytest.fixture(scope="module")
def photos(shared_data):
    return photo_items(shared_data)


@pytest.fixture(scope="module")
def photo_index(photos):
    return ImageIndex.build(photos, ImageSearchConfig())


def test_degrade_keeps_the_promised_ranges():
    img = np.random.default_rng(0).integers(0, 256, (400, 600, 3), dtype=np.uint8)
    rng = np.random.default_rng(1)
    for _ in range(20):
        out = degrade(img, rng)
        assert out.dtype == np.uint8 and out.ndim == 3
        # area of the crop times scale^2: at most 0.9 of the original and at least 0.5 * 0.3^2
        frac = out.shape[0] * out.shape[1] / (400 * 600)
        assert 0.5 * 0.09 * 0.9 <= frac <= 0.91


def test_image_search_tool_names_the_entity(photos, photo_index):
    i = next(k for k, it in enumerate(photos) if it[1] == "Colosseum")
    query = degrade(photos[i][0], np.random.default_rng(3))
    ctx = ToolContext(images={"img_1": query}, options={"image_search": photo_index})
    tool = REGISTRY["image_search"]
    res = call_tool(tool, {"image": "img_1", "top_k": 3}, ctx)
    assert res.ok, res.text
    first = res.text.splitlines()[1]
    assert first.startswith("1. Colosseum — "), res.text
    assert res.data["hits"][0]["title"] == "Colosseum"
    assert len(res.data["hits"]) <= 3
    assert res.images == {}


def test_image_search_no_match_and_bad_arguments(photo_index):
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (300, 300, 3), dtype=np.uint8)
    ctx = ToolContext(images={"img_1": noise}, options={"image_search": photo_index})
    tool = REGISTRY["image_search"]
    res = call_tool(tool, {"image": "img_1"}, ctx)
    assert res.ok and res.data["hits"] == [] and "no match" in res.text
    for bad in ({"image": "img_9"}, {"image": "img_1", "top_k": 0}, {"image": "img_1", "top_k": "3"},
                {"image": "img_1", "query": "x"}, {}):
        res = call_tool(tool, bad, ctx)
        assert not res.ok and res.error.kind == "invalid_call", bad


def test_numbered_variants_count_once(photos):
    fish = [it for it in photos if it[1] == "Fish"][:3]
    index = ImageIndex.build(fish + [photos[0]], ImageSearchConfig())
    hits = index.search(fish[1][0], top_k=5)
    assert [h.title for h in hits].count("Fish") == 1
    assert hits[0].title == "Fish" and hits[0].image == fish[1][3]


@pytest.mark.slow
def test_image_search_acceptance_300_degraded_queries(photos, photo_index):
    """>= 90 % top-1 over 300 seeded degraded queries of all gcompris + skimage photos."""
    rng = np.random.default_rng(2026)
    ok, lat = 0, []
    failures = []
    for _ in range(300):
        i = int(rng.integers(len(photos)))
        query = degrade(photos[i][0], rng)
        t = time.perf_counter()
        hits = photo_index.search(query, top_k=5)
        lat.append(time.perf_counter() - t)
        if hits and hits[0].title.casefold() == photos[i][1].casefold():
            ok += 1
        else:
            failures.append((photos[i][1], hits[0].title if hits else None, query.shape))
    acc = ok / 300
    print(json.dumps({"image_search_top1": acc, "n": 300, "index_images": len(photos),
                      "p50_s": float(np.median(lat)), "p90_s": float(np.percentile(lat, 90)),
                      "failures": failures[:10]}))
    assert acc >= 0.90


def test_default_index_is_built_from_the_kg_anchors(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from osvl.kg.schema import SAMPLE_DIR  # committed: missing, the test fails

    monkeypatch.setenv("OSVL_CACHE", str(tmp_path))
    index = build_image_index(SAMPLE_DIR)
    anchors = pq.read_table(SAMPLE_DIR / "anchors.parquet").to_pylist()
    assert len(index.entries) == len(anchors)
    assert list((tmp_path / "image_index").glob("*.npz")), "index not cached on disk"
    again = build_image_index(SAMPLE_DIR)
    assert again.backend_id == index.backend_id and len(again.descriptors) == len(index.descriptors)
    a = anchors[0]
    query = degrade(_load_rgb(SAMPLE_DIR / "images" / a["image"]), np.random.default_rng(0))
    ctx = ToolContext(images={"img_1": query}, options={"image_search": index})
    res = image_search_fn(ctx, image="img_1")
    titles = {e["title"] for e in index.entries if e["image"] == a["image"]}
    assert res.data["hits"] and res.data["hits"][0]["title"] in titles, res.text
    # a hit shows a page snippet: the description, then the opening of the article
    ent = pq.read_table(SAMPLE_DIR / "entities.parquet", filters=[("id", "=", a["entity_id"])]).to_pylist()[0]
    assert res.data["hits"][0]["snippet"].startswith(f"{ent['description']}. {' '.join(ent['text'].split()[:4])}")


# ---------------------------------------------------------------------------
# text search


@pytest.fixture(scope="module")
def kg_entities():
    import pyarrow.parquet as pq

    from osvl.kg.schema import SAMPLE_DIR  # committed: missing, the test fails

    return pq.read_table(SAMPLE_DIR / "entities.parquet",
                         columns=["title", "aliases", "description", "text", "attributes"]).to_pylist()


@pytest.fixture(scope="module")
def small_index(kg_entities):
    """BM25 over 300 real KG entities (the Wikispeedia ones with text), description excluded."""
    ents = [e for e in kg_entities if e["text"] and e["description"]][:300]
    return ents, TextIndex.build(ents, TextSearchConfig(exclude_fields=["description"], dense_rerank=False))


def test_text_search_finds_an_entity_by_its_own_words(small_index):
    ents, index = small_index
    e = ents[123]
    words = " ".join(e["text"].split()[5:17])  # a phrase from inside the article
    hits = index.search(words, 5)
    assert hits and hits[0].title == e["title"], (words, [h.title for h in hits])
    assert len({h.title for h in hits}) == len(hits) <= 5  # one hit per entity


def test_excluded_fields_are_not_searchable(small_index):
    ents, index = small_index
    assert all(e["description"] not in p for e in ents[:50] for p in index.passages if len(e["description"]) > 25)
    full = TextIndex.build(ents, TextSearchConfig(dense_rerank=False))
    e = next(x for x in ents if len(x["description"].split()) >= 3)
    lead = full.passages[int(np.flatnonzero(full.owner == ents.index(e))[0])]
    assert e["description"] in lead and e["description"] not in index.passages[
        int(np.flatnonzero(index.owner == ents.index(e))[0])]
    with pytest.raises(ConfigError, match="unknown field"):
        TextIndex.build(ents, TextSearchConfig(exclude_fields=["descriptoin"]))


def test_text_search_tool_contract(small_index):
    ents, index = small_index
    ctx = ToolContext(images={}, options={"text_search": index})
    tool = REGISTRY["text_search"]
    title = ents[7]["title"]
    res = call_tool(tool, {"query": f"  {title}\n", "top_k": 3}, ctx)
    assert res.ok and res.text.splitlines()[0] == f'Search results for "{title}":'
    assert res.text.splitlines()[1] == f"1. {res.data['hits'][0]['title']}"
    assert 1 <= len(res.data["hits"]) <= 3
    assert call_tool(tool, {"query": "the of and"}, ctx).text == 'No results for "the of and".'
    for bad in ({"query": ""}, {"query": "   "}, {"query": 3}, {"query": "x" * 501}, {"query": "x", "top_k": 21},
                {"query": "x", "top_k": 1.5}, {"top_k": 3}, {"query": "x", "image": "img_1"}):
        res = call_tool(tool, bad, ctx)
        assert not res.ok and res.error.kind == "invalid_call", bad


def _entity(title, text="", attributes=(), categories=(), linked_from=()):
    return {"title": title, "aliases": [], "description": f"Thing called {title}", "text": text,
            "attributes": [{"key": k, "value": v} for k, v in attributes], "categories": list(categories),
            "linked_from": list(linked_from)}


def test_numbers_facts_links_and_query_centred_snippets():
    """What the oracle's hops need: infobox numbers are searchable, a category plus the article that
    mentions an entity finds it, and the snippet shows the matching sentence or fact, not the opening."""
    filler = " ".join(f"Sentence number {w} says nothing in particular." for w in ("one", "two", "three", "four",
                                                                                    "five", "six", "seven"))
    ents = [
        _entity("Sulfur", filler + " It burns with a blue flame.", [("Bulk modulus", "7.7 GPa"), ("Density", "2 g")],
                ["subject.Science.Chemistry"], ["Gunpowder"]),
        _entity("Selenium", "Selenium is grey.", [("Bulk modulus", "8.3 GPa")], ["subject.Science.Chemistry"]),
        _entity("Granite", "Granite is a rock.", categories=["subject.Geography.Mineralogy"],
                linked_from=["Tower Bridge", "Sand"]),
        _entity("Quartz", "Quartz is a mineral.", categories=["subject.Geography.Mineralogy"], linked_from=["Sand"]),
        _entity("Tower Bridge", "Tower Bridge crosses the Thames.", [("Opening date", "1894")]),
    ] + [_entity(f"Other {i}", f"Other {i} is unrelated to anything.") for i in range(20)]
    index = TextIndex.build(ents, TextSearchConfig(dense_rerank=False))
    hits = index.search("Bulk modulus 7.7 GPa", 3)
    assert hits[0].title == "Sulfur" and "Bulk modulus: 7.7 GPa." in hits[0].snippet, hits
    hits = index.search("Tower Bridge Mineralogy", 5)
    titles = [h.title for h in hits]
    assert titles.index("Granite") < titles.index("Quartz"), titles
    assert "Mentioned in the article on Tower Bridge." in hits[titles.index("Granite")].snippet
    hit = index.search("Sulfur blue flame", 1)[0]
    assert hit.title == "Sulfur" and "It burns with a blue flame." in hit.snippet and "number one" not in hit.snippet
    assert all(len(h.snippet) <= index.cfg.snippet_chars + 2 for h in index.search("Sulfur", 5))


def test_index_is_cached_on_disk_by_content(tmp_path, monkeypatch, kg_entities):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    kg = tmp_path / "kg"
    kg.mkdir()
    rows = [e for e in kg_entities if e["text"]][:200]
    pq.write_table(pa.Table.from_pylist(rows), kg / "entities.parquet")
    cfg = TextSearchConfig(dense_rerank=False)
    a = build_text_index(kg, cfg=cfg)
    folders = list((tmp_path / "cache" / "text_index").iterdir())
    assert len(folders) == 1 and (folders[0] / "meta.json").is_file()
    b = build_text_index(kg, cfg=cfg)  # loaded from disk
    q = " ".join(rows[42]["text"].split()[3:12])
    assert a.backend_id == b.backend_id and [h.title for h in a.search(q)] == [h.title for h in b.search(q)]
    c = build_text_index(kg, exclude_fields=["description"], cfg=cfg)  # other passages: other index
    pq.write_table(pa.Table.from_pylist(rows[:150]), kg / "entities.parquet")  # other content: other index
    d = build_text_index(kg, cfg=cfg)
    assert len({a.backend_id, c.backend_id, d.backend_id}) == 3
    assert len(list((tmp_path / "cache" / "text_index").iterdir())) == 3


def test_a_lazy_backend_builds_its_index_once_on_the_first_search(tmp_path, kg_entities):
    """An environment's search backend (``osvl.agent.env``): no index is built before the first search, however
    many threads search at once only one is, and its cache key (``backend_id``) is known without it."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    from osvl.tools.base import LazyBackend

    kg = tmp_path / "kg"
    kg.mkdir()
    pq.write_table(pa.Table.from_pylist([e for e in kg_entities if e["text"]][:50]), kg / "entities.parquet")
    built: list[TextSearchConfig] = []

    def build(cfg: TextSearchConfig) -> TextIndex:
        built.append(cfg)
        return build_text_index(kg, cfg=cfg, cache=False)

    backend = LazyBackend(build, TextSearchConfig(dense_rerank=False))
    same = LazyBackend(build, TextSearchConfig(dense_rerank=False))
    assert not built and backend.backend_id == same.backend_id
    assert backend.backend_id != LazyBackend(build, TextSearchConfig(snippet_chars=120)).backend_id
    title = kg_entities[0]["title"]
    with ThreadPoolExecutor(4) as pool:
        hits = list(pool.map(lambda _: backend.search(title, 3), range(4)))
    assert len(built) == 1 and all(h == hits[0] for h in hits) and hits[0]


@pytest.mark.slow
def test_dense_rerank_is_at_least_as_good_as_bm25(small_index):
    """MiniLM re-rank of the 10 best entities, on 40 descriptions of the 300-entity index."""
    ents, bm25 = small_index
    dense = TextIndex.build(ents, TextSearchConfig(exclude_fields=["description"], dense_rerank=True, rerank_depth=10))
    queries = [e for e in ents if len(e["description"].split()) >= 2][:40]
    top = {"bm25": 0, "dense": 0}
    for e in queries:
        top["bm25"] += e["title"] in [h.title for h in bm25.search(e["description"], 5)]
        top["dense"] += e["title"] in [h.title for h in dense.search(e["description"], 5)]
    print(json.dumps(top))
    assert top["dense"] >= top["bm25"] and top["dense"] >= 0.6 * len(queries)
    assert 0 < len(dense._emb) <= 10 * len(queries)  # only re-ranked entities were embedded, each once


@pytest.mark.slow
def test_text_search_acceptance_unique_descriptions(monkeypatch):
    """Gold article in the top 5 for >= 80 % of 200 seeded entities queried by their unique description."""
    import collections
    import random

    import pyarrow.parquet as pq

    from osvl.kg.schema import SAMPLE_DIR  # committed: missing, the test fails

    # dense_recall embeds all ~12.6k entities once, cached beside the index under the machine's cache
    # (OSVL_CACHE, else ~/.cache/osvl; keyed by the sample's content hash and the settings): minutes of CPU on
    # a cold cache, so the suite leaves it there for the next run, as the vLLM environment is (.ci/run)
    from osvl.storage import cache_root

    monkeypatch.setenv("OSVL_CACHE", str(cache_root()))
    index = build_text_index(SAMPLE_DIR, exclude_fields=["description"],
                             cfg=TextSearchConfig(dense_rerank=True, dense_recall=10))
    assert index.dense is not None and index.dense.shape == (len(index.titles), 384)
    ents = pq.read_table(SAMPLE_DIR / "entities.parquet", columns=["title", "description"]).to_pylist()
    count = collections.Counter(e["description"] for e in ents)
    pool = [e for e in ents if e["description"] and count[e["description"]] == 1]
    picked = random.Random(0).sample(pool, 200)
    ok, lat = 0, []
    for e in picked:
        t = time.perf_counter()
        hits = index.search(e["description"], 5)
        lat.append(time.perf_counter() - t)
        ok += e["title"] in [h.title for h in hits]
    acc = ok / 200
    print(json.dumps({"text_search_top5": acc, "n": 200, "pool": len(pool), "entities": len(ents),
                      "p50_s": float(np.median(lat)), "p90_s": float(np.percentile(lat, 90))}))
    assert acc >= 0.80
