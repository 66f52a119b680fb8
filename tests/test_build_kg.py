"""jobs/build_kg.py: the Ray Data dump -> KG job, on the real shared MediaWiki sample."""

from __future__ import annotations

import bz2
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from osvl.config import RunConfig
from osvl.kg import mediawiki
from osvl.kg.dump import iter_waves, parse_shard, shard_path
from osvl.kg.job import BuildKGConfig, run
from osvl.kg.schema import fold, load_kg

REPO = Path(__file__).resolve().parents[1]
MW_SAMPLE = "mediawiki/enwiki-pages-articles-sample.xml.bz2"
CORRUPT_PAGE = """  <page>
    <title>Corrupt page</title>
    <ns>zero</ns>
    <id>not-a-number</id>
    <revision><id>1</id><text xml:space="preserve">{{Infobox person | name = Nobody}} [[Aristotle]]</text></revision>
  </page>
"""


LINKER_PAGE = """  <page>
    <title>Linker</title>
    <ns>0</ns>
    <id>99999999</id>
    <revision><id>2</id><text xml:space="preserve">{{Infobox philosopher
| name = Linker
| influences = [[AynRand]]
}}
Linker read [[Aristotle]] and admired [[Astronomers and Astrophysicists|astronomers]].</text></revision>
  </page>
"""


def _cfg(root: Path, source: Path, name: str) -> BuildKGConfig:
    return BuildKGConfig(run=RunConfig(root=str(root), name=name), input=str(source), shard_pages=20, workers=2)


def _edges(kg) -> set[tuple[str, str, str]]:
    return {(kg.entities[s]["title"], kg.entities[d]["title"], r) for s, adj in kg.out_links.items() for d, r in adj}


@pytest.fixture(scope="module")
def built(ray_cluster, shared_data: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    source = shared_data / MW_SAMPLE
    kg_dir, report = run(_cfg(root, source, "clean"), log=lambda m: None)
    return root, kg_dir, report, source


@pytest.fixture(scope="module")
def extended(ray_cluster, shared_data: Path, tmp_path_factory):
    """The sample plus an article linking through redirects and, mid-stream, a corrupt page.

    Returns that run's KG folder and counts, and the same export without the corrupt page
    (for the in-memory ``mediawiki.load``, which stops at a bad page, to compare with).
    """
    tmp = tmp_path_factory.mktemp("extended")
    raw = bz2.decompress((shared_data / MW_SAMPLE).read_bytes()).decode("utf-8")
    with_linker = raw.replace("</mediawiki>", LINKER_PAGE + "</mediawiki>")
    cut = with_linker.index("  <page>", len(with_linker) // 2)  # mid-stream, not at a shard edge
    clean, broken = tmp / "clean.xml.bz2", tmp / "corrupt.xml.bz2"
    clean.write_bytes(bz2.compress(with_linker.encode("utf-8")))
    broken.write_bytes(bz2.compress((with_linker[:cut] + CORRUPT_PAGE + with_linker[cut:]).encode("utf-8")))
    kg_dir, report = run(_cfg(tmp / "runs", broken, "corrupt"), log=lambda m: None)
    return kg_dir, report, clean


def test_help_runs_as_a_subprocess() -> None:
    out = subprocess.run([sys.executable, "jobs/build_kg.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--shard_pages=" in out.stdout and "production" in out.stdout


def test_parse_shard_skips_and_counts_bad_pages() -> None:
    good = {"title": "Aristotle", "ns": "0", "id": "1", "redirect": "", "text": "[[Plato]] taught him."}
    bad = {"title": "Broken", "ns": "zero", "id": "2", "redirect": "", "text": ""}
    untitled = {"title": "", "ns": "0", "id": "3", "redirect": "", "text": "x"}
    talk = {"title": "Talk:Aristotle", "ns": "1", "id": "4", "redirect": "", "text": ""}
    rows, stats = parse_shard([good, bad, untitled, talk])
    assert [r["title"] for r in rows] == ["Aristotle"] and rows[0]["links"] == [{"target": "Plato",
                                                                               "relation": "linked_to"}]
    assert (stats["pages"], stats["articles"], stats["bad"], stats["other_ns"]) == (4, 1, 2, 1)
    assert "Broken" in stats["bad_examples"][0] and "empty title" in stats["bad_examples"][1]


@pytest.mark.slow
def test_sample_kg_equals_in_memory_load(built, shared_data: Path) -> None:
    _, kg_dir, report, _ = built
    kg = load_kg(kg_dir)
    ents, links = mediawiki.load(shared_data / MW_SAMPLE)
    title = {e["id"]: e["title"] for e in ents}
    assert sorted(e["title"] for e in kg.entities.values()) == sorted(title.values())
    assert _edges(kg) == {(title[s], title[d], r) for s, d, r in links}
    assert report["entities"] == 106 and report["bad"] == 0 and report["shards"] == 11
    assert report["articles"] == 106 and report["redirects"] == 99 and report["parsed_this_run"] == 11
    by_title = {e["title"]: e for e in kg.entities.values()}
    # same per-entity content as the in-memory loader, not just the same names
    for e in ents:
        mine = by_title[e["title"]]
        assert mine["aliases"] == e["aliases"] and mine["images"] == e["images"] and mine["kind"] == e["kind"]
        assert [(a["key"], a["value"]) for a in mine["attributes"]] == [(a["key"], a["value"]) for a in e["attributes"]]


@pytest.mark.slow
def test_every_redirect_is_an_alias_of_its_target(built, shared_data: Path) -> None:
    kg = load_kg(built[1])
    aliased = 0
    for p in mediawiki.iter_pages(shared_data / MW_SAMPLE):
        if p.ns == 0 and p.redirect and fold(p.redirect) in kg.by_title:
            target = kg.by_title[fold(p.redirect)]
            assert p.title in kg.entities[target]["aliases"], (p.title, p.redirect)
            assert kg.find(p.title) == [target]  # the alias finds its target
            aliased += 1
    # nothing else became an alias (the other 86 redirects point outside the sample: no entity)
    assert aliased == sum(len(e["aliases"]) for e in kg.entities.values()) == 13


@pytest.mark.slow
def test_links_resolve_through_redirects(extended) -> None:
    """The sample never links to one of its own redirects, so a real-format article that does is added."""
    kg = load_kg(extended[0])
    src = kg.by_title["linker"]
    out = set(kg.out_links[src])
    assert (kg.by_title["ayn rand"], "influences") in out  # [[AynRand]] in the infobox; AynRand -> Ayn Rand
    assert (kg.by_title["astronomer"], "linked_to") in out  # [[Astronomers and Astrophysicists|...]] in the text
    assert (kg.by_title["aristotle"], "linked_to") in out  # a direct link resolves directly
    assert len(out) == 3


@pytest.mark.slow
def test_infobox_attributes_of_known_pages(built) -> None:
    kg = load_kg(built[1])
    attrs = {e["title"]: {a["key"]: a for a in e["attributes"]} for e in kg.entities.values()}
    assert attrs["Aristotle"]["nationality"]["value"] == "Greek"
    assert attrs["Aristotle"]["birth date"]["value"] == "384 BC"
    assert attrs["Abraham Lincoln"]["order"]["value"] == "16th"
    assert attrs["Alabama"]["Fullname"]["value"] == "State of Alabama"
    assert attrs["Aristotle"]["nationality"]["source"].startswith("| nationality =")


@pytest.mark.slow
def test_corrupt_page_is_skipped_and_counted(extended, built) -> None:
    kg_dir, report, without_corrupt = extended
    assert report["bad"] == 1 and "Corrupt page" in report["bad_examples"][0]
    assert report["pages"] == built[2]["pages"] + 2 and report["entities"] == built[2]["entities"] + 1
    ents, links = mediawiki.load(without_corrupt)  # the same export minus the corrupt page, in memory
    title = {e["id"]: e["title"] for e in ents}
    kg = load_kg(kg_dir)
    assert sorted(e["title"] for e in kg.entities.values()) == sorted(title.values())
    assert _edges(kg) == {(title[s], title[d], r) for s, d, r in links}


@pytest.mark.slow
def test_rerun_rewrites_only_the_deleted_shard(built) -> None:
    root, kg_dir, report, source = built
    shard_dir = kg_dir.parent / "shards"
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.glob("*.parquet")}
    tables = {n: pq.read_table(kg_dir / n) for n in ("entities.parquet", "links.parquet")}
    shard_path(shard_dir, 3).unlink()
    logs: list[str] = []
    kg_dir2, report2 = run(_cfg(root, source, "clean"), log=logs.append)
    assert kg_dir2 == kg_dir and report2["parsed_this_run"] == 1
    assert any(line.strip().startswith("shard      3:") for line in logs)
    after = {p.name: p.stat().st_mtime_ns for p in shard_dir.glob("*.parquet")}
    assert after.keys() == before.keys()
    assert [n for n in before if after[n] != before[n]] == [shard_path(shard_dir, 3).name]
    for name, table in tables.items():
        assert pq.read_table(kg_dir / name).equals(table), name
    assert json.loads((kg_dir.parent / "counts.json").read_text())["entities"] == report["entities"]


def test_waves_keep_shard_boundaries_when_shards_are_skipped(shared_data: Path) -> None:
    source = shared_data / MW_SAMPLE
    full = [item for items, _ in iter_waves(source, 20, 3, set()) for item in items]
    assert [it["shard"] for it in full] == list(range(11)) and sum(len(it["pages"]) for it in full) == 206
    waves = list(iter_waves(source, 20, 3, {0, 2, 7}))
    assert [[it["shard"] for it in items] for items, _ in waves] == [[1, 3, 4], [5, 6, 8], [9, 10]]
    assert [streamed for _, streamed in waves] == [100, 180, 206]  # a wave goes out as soon as it is full
    kept = {it["shard"]: it["pages"] for items, _ in waves for it in items}
    assert all(kept[k] == full[k]["pages"] for k in kept)  # a skipped shard does not shift the next ones


def test_parts_write_the_same_tables_as_write_kg_with_duplicate_and_self_links(tmp_path):
    """``schema.write_kg_parts`` (the bounded builds' writer) keeps the first of each (src, dst, relation) and no
    self-link, in order, with degrees over distinct pairs: the same files as ``write_kg`` over the whole rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from osvl.kg.schema import ENTITIES_SCHEMA, LINKS_SCHEMA, write_kg, write_kg_parts

    ents = [{"id": i, "title": f"E{i}", "aliases": [], "description": "", "text": "", "images": [],
             "categories": [], "in_degree": 0, "out_degree": 0, "kind": "article", "origin": "wikidata",
             "attributes": [{"key": "colour", "value": ["red", "blue"][i % 2], "source": "p", "eligible": None}]}
            for i in range(6)]
    links = [(0, 1, "a"), (0, 1, "a"), (0, 1, "b"), (1, 1, "a"), (2, 0, "a"), (1, 0, "a"), (0, 1, "a"),
             (3, 4, "c"), (3, 3, "c"), (4, 5, "c"), (3, 4, "c"), (5, 0, "a")]
    write_kg(tmp_path / "whole", ents, links)
    parts = []
    for k, (lo, hi) in enumerate(((0, 3), (3, 6))):
        e, lk = tmp_path / f"e{k}.parquet", tmp_path / f"l{k}.parquet"
        pq.write_table(pa.Table.from_pylist(ents[lo:hi], schema=ENTITIES_SCHEMA), e)
        mine = [x for x in links if lo <= x[0] < hi]
        pq.write_table(pa.table({"src": [x[0] for x in mine], "dst": [x[1] for x in mine],
                                 "relation": [x[2] for x in mine]}, schema=LINKS_SCHEMA), lk)
        parts.append((e, lk))
    write_kg_parts(tmp_path / "parts", parts)
    for name in ("entities", "links"):
        assert pq.read_table(tmp_path / "parts" / f"{name}.parquet").equals(
            pq.read_table(tmp_path / "whole" / f"{name}.parquet")), name
    got = pq.read_table(tmp_path / "parts" / "links.parquet").to_pylist()
    assert [(r["src"], r["dst"], r["relation"]) for r in got] == [
        (0, 1, "a"), (0, 1, "b"), (2, 0, "a"), (1, 0, "a"), (3, 4, "c"), (4, 5, "c"), (5, 0, "a")]
