"""The compiled, memory-mapped KG (``osvl.kg.compiled``) behind ``walks.Graph``.

Expected values are read straight from the sample KG's Parquet tables with pyarrow, not through
``Graph``: the compiled form must hand synthesis exactly what the tables say.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from osvl.kg.schema import SAMPLE_DIR, fold

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kg-compiled"


def _copy_sample(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("entities.parquet", "links.parquet", "anchors.parquet"):
        shutil.copy(SAMPLE_DIR / name, dst / name)
    return dst


def test_compiled_sample_matches_the_tables(cache):
    from osvl.synth.walks import Graph, _answers, _is_list_page

    graph = Graph.load(SAMPLE_DIR)
    rows = pq.read_table(SAMPLE_DIR / "entities.parquet").to_pylist()
    links = pq.read_table(SAMPLE_DIR / "links.parquet").to_pylist()
    anchors = pq.read_table(SAMPLE_DIR / "anchors.parquet").to_pylist()
    assert len(graph.entities) == len(rows) and list(graph.entities) == [r["id"] for r in rows]
    assert not graph.bad and graph.root == SAMPLE_DIR
    links_from: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for link in links:
        links_from[link["src"]].append((link["dst"], link["relation"] or "linked_to"))
    by_name: dict[str, set[int]] = defaultdict(set)
    values: Counter[str] = Counter()
    for r in rows:
        for name in [r["title"], *r["aliases"]]:
            by_name[fold(name)].add(r["id"])
        values.update(fold(v) for _, v in _answers(r["attributes"], 6))
    names = {r["id"]: [r["title"], *r["aliases"]] for r in rows}
    anchored = {a["entity_id"] for a in anchors}
    sample = [r for r in rows if r["id"] % 37 == 0 or r["id"] in anchored]
    for r in sample:
        eid = r["id"]
        ent = graph.entities[eid]
        assert (ent.title, ent.aliases, ent.description, ent.categories, ent.in_degree) == (
            r["title"], r["aliases"], r["description"], r["categories"], r["in_degree"])
        assert ent.attributes == [(a["key"], a["value"]) for a in r["attributes"]]
        assert ent.answers == _answers(r["attributes"], 6)
        assert ent.list_page == _is_list_page(r)
        assert graph.links_from[eid] == links_from[eid]
        assert graph.neighbours(eid) == sorted({d for d, _ in links_from[eid]})
        assert [(a.image, a.score) for a in graph.anchors[eid]] == [
            (a["image"], pytest.approx(a["score"])) for a in anchors if a["entity_id"] == eid]
        for _, value in ent.answers + [("title", ent.title)]:
            want = {n for e in by_name[fold(value)] for n in names[e]} - {value}
            assert graph.answer_aliases(value) == sorted(want)
            assert graph.value_count[fold(value)] == values[fold(value)]
    assert graph.seeds() == sorted(e for e in anchored if not graph.entities[e].list_page)
    assert 10**9 not in graph.entities and graph.links_from.get(10**9) is None


def test_in_memory_rows_compile_to_the_same_graph(cache):
    from osvl.synth.walks import Graph

    ents = [{"id": 5, "title": "A", "aliases": ["Alpha"], "attributes": [{"key": "Color", "value": "red"}]},
            {"id": 2, "title": "B", "categories": ["x"]},
            {"id": 9, "title": None, "attributes": [{"key": None, "value": 1}]},  # malformed: skipped, counted
            {"title": "no id"}]
    links = [{"src": 5, "dst": 2, "relation": "linked_to"}, {"src": 5, "dst": 2, "relation": "Capital"},
             {"src": 2, "dst": 5, "relation": None}, {"src": 5, "dst": 5, "relation": "self"},
             {"src": 5, "dst": 9, "relation": "to a skipped row"}]
    g = Graph(ents, links, [{"entity_id": 5, "image": "a.jpg", "score": 0.5}, {"entity_id": 77, "image": "b.jpg"}])
    assert list(g.entities) == [5, 2] and g.bad == {"entity": 2, "link": 2}
    assert g.links_from[5] == [(2, "linked_to"), (2, "Capital")] and g.out[5] == [(2, "Capital")]
    assert g.links_from[2] == [(5, "linked_to")] and g.entities[2].in_degree == 2  # counted from the links
    assert g.answer_aliases("alpha") == ["A", "Alpha"] and g.value_count["red"] == 1
    assert g.seeds() == [5] and g.anchors[2] == []


_WORKER = """
import json, os, sys, time
import osvl.kg.compiled as c
from osvl.synth.walks import Graph
compile_folder = c.compile_folder
def counted(*args):
    print("COMPILED", flush=True)
    compile_folder(*args)
c.compile_folder = counted
while time.time() < float(sys.argv[2]):  # both processes reach ensure() together
    time.sleep(0.005)
g = Graph.load(sys.argv[1])
assert g.neighbours(g.seeds()[0]) and g.entities[g.seeds()[0]].title
maps = {}
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and "kg-compiled" in parts[5]:
        maps[os.path.basename(parts[5])] = int(parts[4])  # file name -> inode
print(json.dumps({"folder": str(g._kg.folder), "maps": maps}))
"""


def test_two_processes_compile_once_and_map_the_same_files(cache, tmp_path):
    kg = _copy_sample(tmp_path / "kg")
    start = str(time.time() + 4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(kg), start], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=REPO) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("COMPILED") for o in outs) == 1
    a, b = (json.loads(o.strip().splitlines()[-1]) for o in outs)
    assert a["folder"] == b["folder"] and [p.name for p in cache.iterdir() if p.is_dir()] == [Path(a["folder"]).name]
    for name in ("entities.arrow", "link_offsets.npy", "link_dst.npy", "ids.npy", "id_sorted.npy"):
        assert a["maps"][name] == b["maps"][name] == os.stat(Path(a["folder"]) / name).st_ino
    meta = json.loads((Path(a["folder"]) / "meta.json").read_text())
    assert meta["compiled_by"] in {p.pid for p in procs}


def test_a_changed_kg_gets_its_own_folder(cache, tmp_path):
    import pyarrow as pa

    from osvl.synth.walks import Graph

    kg = _copy_sample(tmp_path / "kg")
    first = Graph.load(kg)
    again = Graph.load(kg)
    assert again._kg.folder == first._kg.folder
    table = pq.read_table(kg / "entities.parquet")
    titles = table.column("title").to_pylist()
    eid = table.column("id")[0].as_py()
    titles[0] = "A renamed entity"
    pq.write_table(table.set_column(1, "title", pa.array(titles)), kg / "entities.parquet")
    changed = Graph.load(kg)
    assert changed._kg.folder != first._kg.folder
    assert changed.entities[eid].title == "A renamed entity" != first.entities[eid].title
    assert Graph.load(kg, max_answer_words=3)._kg.folder not in (first._kg.folder, changed._kg.folder)
    assert isinstance(changed._kg.dst, np.memmap)
