"""The knowledge-graph contract: three Parquet tables and ``load_kg`` (the in-memory graph).

A KG folder holds ``entities.parquet``, ``links.parquet``, ``anchors.parquet`` and an
``images/`` folder. Every loader (Wikispeedia, MediaWiki XML, Wikidata JSON dumps and triples) writes
these tables through ``write_kg``, which validates them, and every consumer (walks,
search, tests) reads them through ``load_kg``. The tables are plain Parquet so that a
Ray Data job can read or shard them without osvl.

``entities.parquet`` (one row per entity):
    id           int64    stable within one KG folder (not across builds)
    title        string   article title, spaces not underscores
    aliases      list<string>  other names: redirects, names from the lead, manifest names
    description  string   Wikidata short description ("" when unknown)
    text         string   article text, trimmed (the sample keeps the lead paragraphs)
    attributes   list<struct<key, value, source, eligible>>
                 key/value from infobox lines or templates; ``source`` is the line (or
                 template field) it came from; ``eligible`` says whether the value may be
                 the answer of a synthesized question: at most 6 words (alphanumeric tokens,
                 as ``fold`` splits them) and not shared by more than 1% of entities
                 (``Kingdom: Animalia`` is not); list/index/disambiguation pages have none.
    images       list<string>  image file names relative to the folder's ``images/``
                 (MediaWiki ``[[File:...]]`` names are kept as names even when the file
                 itself is not in the folder)
    categories   list<string>  e.g. ``subject.Countries`` (Wikispeedia) or wiki categories
    in_degree    int32    number of links pointing here (computed by ``write_kg``)
    out_degree   int32    number of links leaving here (computed by ``write_kg``)
    kind         string   one of ``KINDS``: walks skip ``list``/``index``/``disambiguation``
                 pages as answers and as intermediate hops
    origin       string   which loader made the row: ``wikispeedia``, ``wikidata``, ``mediawiki``,
                 ``manifest`` (an artwork named only by an image manifest)

``links.parquet`` (one row per directed edge, no duplicates of (src, dst, relation)):
    src, dst     int64    entity ids
    relation     string   the attribute key whose value names ``dst``, else ``linked_to``

``anchors.parquet`` (grounded images: photos shown to the agent as the question image):
    entity_id    int64
    image        string   file name under ``images/``
    caption      string   the caption the photo came with
    source       string   where it came from (manifest path, package name)
    licence      string   licence of that one file
    score        float32  the grounding score (see ``osvl.kg.grounding``)
    scorer       string   which scorer produced ``score`` (e.g. ``minilm``, ``clip``)

Only accepted images are rows of ``anchors.parquet``; rejections are counted by the
builder, not stored, so that a consumer never has to remember to filter.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl.errors import DataError

KINDS = ("article", "list", "index", "disambiguation")
"""Entity kinds. Only ``article`` entities are answers or intermediate walk hops."""

ORIGINS = ("wikispeedia", "wikidata", "mediawiki", "manifest")

DEFAULT_RELATION = "linked_to"

ATTRIBUTE_TYPE = pa.struct(
    [
        ("key", pa.string()),
        ("value", pa.string()),
        ("source", pa.string()),
        ("eligible", pa.bool_()),
    ]
)

ENTITIES_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("title", pa.string()),
        ("aliases", pa.list_(pa.string())),
        ("description", pa.string()),
        ("text", pa.string()),
        ("attributes", pa.list_(ATTRIBUTE_TYPE)),
        ("images", pa.list_(pa.string())),
        ("categories", pa.list_(pa.string())),
        ("in_degree", pa.int32()),
        ("out_degree", pa.int32()),
        ("kind", pa.string()),
        ("origin", pa.string()),
    ]
)

LINKS_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64()), ("relation", pa.string())])

ANCHORS_SCHEMA = pa.schema(
    [
        ("entity_id", pa.int64()),
        ("image", pa.string()),
        ("caption", pa.string()),
        ("source", pa.string()),
        ("licence", pa.string()),
        ("score", pa.float32()),
        ("scorer", pa.string()),
    ]
)

MAX_ANSWER_WORDS = 6
"""An attribute value longer than this is not an eligible answer (the recipe's short answers)."""

MAX_SHARED_FRACTION = 0.01
"""A value carried by more than this fraction of entities (``Animalia``) is not an eligible answer."""


def fold(name: str) -> str:
    """Normalise a name for matching: accents dropped, case folded, punctuation to spaces.

    ``Chichén Itzá``, ``chichen_itza`` and ``Chichen-Itza`` all fold to ``chichen itza``;
    used for title and alias lookup everywhere so that every module matches alike.
    """
    s = unicodedata.normalize("NFKD", name)
    s = "".join(c for c in s if not unicodedata.combining(c)).casefold()
    s = re.sub(r"[\W_]+", " ", s)
    return s.strip()


@dataclass
class KG:
    """The graph in memory: rows by id, lookups by folded name, adjacency both ways.

    Rows are plain dicts (the Parquet columns) rather than objects: the graph is ~10^4
    entities, and dicts keep consumers free to read any documented column.
    """

    root: Path
    entities: dict[int, dict[str, Any]]
    by_title: dict[str, int]
    by_alias: dict[str, list[int]]
    out_links: dict[int, list[tuple[int, str]]]
    in_links: dict[int, list[tuple[int, str]]]
    anchors: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entities)

    def find(self, name: str) -> list[int]:
        """Ids whose title (first) or alias folds like ``name``; empty when none."""
        key = fold(name)
        hits = [self.by_title[key]] if key in self.by_title else []
        hits += [i for i in self.by_alias.get(key, ()) if i not in hits]
        return hits

    def image_path(self, name: str) -> Path:
        return self.root / "images" / name

    def neighbors(self, entity_id: int) -> list[tuple[int, str]]:
        """Out-neighbours with the relation of each edge."""
        return self.out_links.get(entity_id, [])


def _check_columns(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise DataError(f"{name}: missing columns {missing}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise DataError(f"{name}: columns do not match the KG schema: {e}") from e


def eligible_values(attr_rows: Iterable[list[dict[str, Any]]], n_entities: int) -> set[str]:
    """Folded values that may serve as answers: short and not shared by > 1% of entities."""
    holders: dict[str, int] = {}
    for attrs in attr_rows:
        for v in {fold(a["value"]) for a in attrs}:
            holders[v] = holders.get(v, 0) + 1
    limit = max(1, int(MAX_SHARED_FRACTION * n_entities))
    return {
        v for v, n in holders.items() if v and n <= limit and len(v.split()) <= MAX_ANSWER_WORDS
    }


def write_kg(
    root: str | Path,
    entities: list[dict[str, Any]],
    links: list[tuple[int, int, str]],
    anchors: list[dict[str, Any]] | None = None,
) -> dict[str, int]:
    """Validate and write the three tables; fills degrees and attribute eligibility.

    ``entities`` are dicts with the columns above (degrees and ``eligible`` may be
    omitted: they are derived here, from the whole graph, so that no loader can get them
    inconsistent). Duplicate edges and self-loops are dropped. Returns counts.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ids = [e["id"] for e in entities]
    if len(set(ids)) != len(ids):
        raise DataError("entity ids are not unique")
    known = set(ids)
    seen: set[tuple[int, int, str]] = set()
    clean: list[tuple[int, int, str]] = []
    for s, d, r in links:
        if s not in known or d not in known:
            raise DataError(f"link {s}->{d} names an unknown entity")
        if s != d and (s, d, r) not in seen:
            seen.add((s, d, r))
            clean.append((s, d, r))
    indeg: dict[int, int] = {}
    outdeg: dict[int, int] = {}
    for s, d in {(s, d) for s, d, _ in clean}:
        outdeg[s] = outdeg.get(s, 0) + 1
        indeg[d] = indeg.get(d, 0) + 1
    ok_values = eligible_values((e.get("attributes") or [] for e in entities), len(entities))
    rows = []
    for e in entities:
        if e.get("kind", "article") not in KINDS:
            raise DataError(f"entity {e['id']}: kind {e.get('kind')!r} not in {KINDS}")
        if e.get("origin") not in ORIGINS:
            raise DataError(f"entity {e['id']}: origin {e.get('origin')!r} not in {ORIGINS}")
        attrs = [  # a loader may mark a fact never eligible (a claim asked as an entity, not as a string)
            {**a, "eligible": a.get("eligible") is not False and e.get("kind", "article") == "article"
             and fold(a["value"]) in ok_values}
            for a in e.get("attributes") or []
        ]
        rows.append(
            {
                "id": e["id"],
                "title": e["title"],
                "aliases": list(e.get("aliases") or []),
                "description": e.get("description") or "",
                "text": e.get("text") or "",
                "attributes": attrs,
                "images": list(e.get("images") or []),
                "categories": list(e.get("categories") or []),
                "in_degree": indeg.get(e["id"], 0),
                "out_degree": outdeg.get(e["id"], 0),
                "kind": e.get("kind", "article"),
                "origin": e["origin"],
            }
        )
    ent = pa.Table.from_pylist(rows, schema=ENTITIES_SCHEMA)
    lnk = pa.table(
        {"src": [s for s, _, _ in clean], "dst": [d for _, d, _ in clean], "relation": [r for _, _, r in clean]},
        schema=LINKS_SCHEMA,
    )
    anc = pa.Table.from_pylist(anchors or [], schema=ANCHORS_SCHEMA)
    for a in anchors or []:
        if a["entity_id"] not in known:
            raise DataError(f"anchor {a['image']} names unknown entity {a['entity_id']}")
    # zstd keeps the committed sample small; row groups stay default (one file, read whole)
    pq.write_table(ent, root / "entities.parquet", compression="zstd")
    pq.write_table(lnk, root / "links.parquet", compression="zstd")
    pq.write_table(anc, root / "anchors.parquet", compression="zstd")
    return {
        "entities": len(rows),
        "links": len(clean),
        "anchors": len(anchors or []),
        "eligible_attributes": sum(a["eligible"] for r in rows for a in r["attributes"]),
    }


def name_hash(text: str) -> int:
    """A folded string's 64-bit key (stable across processes, unlike ``hash``): the compiled graph's name and value
    indexes and ``write_kg_parts``' eligibility count compare these, not millions of Python strings."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def fold_all(values: list[str]) -> list[str]:
    """``fold`` of each value, each distinct value folded once (a KG repeats its values many times)."""
    folded: dict[str, str] = {}
    return [folded[v] if v in folded else folded.setdefault(v, fold(v)) for v in values]


def _folded_hashes(values: list[str]) -> tuple[list[str], np.ndarray]:
    out = fold_all(values)
    return out, np.array([name_hash(f) for f in out], dtype=np.uint64)


def write_kg_parts(root: str | Path, parts: list[tuple[Path, Path]],
                   anchors: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """``write_kg`` for a KG too large to hold whole: the same rules and the same files, from parts read one at a time.

    ``parts``: (entities file, links file) pairs in id order. An entities file holds ``ENTITIES_SCHEMA`` rows
    (degrees are ignored; an attribute's ``eligible`` false means never an answer, null means by the rules)
    whose ids continue the previous part's from 0; its links file (``LINKS_SCHEMA``, may be missing) the links
    leaving those entities, in order. Two passes: the first writes the links (one of each (src, dst,
    relation), no self-link) and counts the degrees (over distinct (src, dst) pairs) and how many entities
    hold each folded attribute value (by 64-bit hash); the second writes the entities with their degrees and
    eligibility. What stays whole: two degree arrays and the value hashes.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n = sum(pq.ParquetFile(e).metadata.num_rows for e, _ in parts)
    indeg, outdeg = np.zeros(n, np.int32), np.zeros(n, np.int32)
    held: list[np.ndarray] = []
    n_links = n_eligible = lo = 0
    with pq.ParquetWriter(root / ".links.parquet.tmp", LINKS_SCHEMA, compression="zstd") as lw:
        for ents_path, links_path in parts:
            ents = pq.read_table(ents_path, columns=["id", "attributes"])
            ids = ents.column("id").to_numpy()
            if not np.array_equal(ids, np.arange(lo, lo + len(ids))):
                raise DataError(f"{ents_path}: entity ids are not unique and contiguous from {lo}")
            if links_path.is_file():
                lk = pq.read_table(links_path).cast(LINKS_SCHEMA)
                s_, d_ = lk.column("src").to_numpy(), lk.column("dst").to_numpy()
                if len(s_) and (s_.min() < lo or s_.max() >= lo + len(ids) or d_.min() < 0 or d_.max() >= n):
                    raise DataError(f"{links_path}: a link names an unknown entity")
                # the first of each (src, dst, relation), no self-link, in order: in NumPy, not a Python set of
                # tuples (~250 bytes a link: 0.3 GiB of driver peak on a 1 GB triples file)
                rel = pc.dictionary_encode(lk.column("relation").combine_chunks(), null_encoding="encode")
                rows = np.flatnonzero(s_ != d_)
                key = np.stack([s_[rows], d_[rows], rel.indices.to_numpy(zero_copy_only=False)[rows]], axis=1)
                first = np.unique(key, axis=0, return_index=True)[1] if len(rows) else np.zeros(0, np.int64)
                lk = lk.take(pa.array(rows[np.sort(first)], pa.int64()))
                lw.write_table(lk)
                n_links += lk.num_rows
                pairs = np.unique(lk.column("src").to_numpy() * max(n, 1) + lk.column("dst").to_numpy())
                np.add.at(outdeg, pairs // max(n, 1), 1)
                np.add.at(indeg, pairs % max(n, 1), 1)
            attrs = pc.list_flatten(ents.column("attributes"))
            if len(attrs):
                _, h = _folded_hashes(pc.struct_field(attrs, "value").to_pylist())
                owner = pc.list_parent_indices(ents.column("attributes")).to_numpy().astype(np.uint64)
                held.append(np.unique(np.stack([owner, h], axis=1), axis=0)[:, 1])
            lo += len(ids)
    hashes, holders = np.unique(np.concatenate(held), return_counts=True) if held else (
        np.zeros(0, np.uint64), np.zeros(0, np.int64))
    ok_hashes = hashes[holders <= max(1, int(MAX_SHARED_FRACTION * n))]
    with pq.ParquetWriter(root / ".entities.parquet.tmp", ENTITIES_SCHEMA, compression="zstd") as ew:
        for ents_path, _ in parts:
            t = pq.read_table(ents_path).select(ENTITIES_SCHEMA.names)
            kinds, origins = set(t.column("kind").to_pylist()), set(t.column("origin").to_pylist())
            if kinds - set(KINDS) or origins - set(ORIGINS):
                raise DataError(f"{ents_path}: kind {sorted(kinds - set(KINDS))} or origin "
                                f"{sorted(origins - set(ORIGINS))} not in {KINDS} / {ORIGINS}")
            lists = t.column("attributes").combine_chunks()
            attrs = lists.flatten()
            folded, h = _folded_hashes(pc.struct_field(attrs, "value").to_pylist())
            owner = pc.list_parent_indices(lists).to_numpy()
            article = np.asarray(pc.equal(t.column("kind"), "article").to_numpy(zero_copy_only=False))
            given = pc.struct_field(attrs, "eligible").to_numpy(zero_copy_only=False)
            ok = (np.isin(h, ok_hashes) & np.array([bool(f) and len(f.split()) <= MAX_ANSWER_WORDS for f in folded],
                                                    dtype=bool)
                  & (article[owner] if len(owner) else np.zeros(0, bool)) & (given != False))  # noqa: E712 - null: by the rules
            n_eligible += int(ok.sum())
            attrs = pa.StructArray.from_arrays([pc.struct_field(attrs, k) for k in ("key", "value", "source")]
                                               + [pa.array(ok, pa.bool_())], fields=list(ATTRIBUTE_TYPE))
            a, b = t.column("id")[0].as_py() if t.num_rows else 0, t.num_rows
            t = t.set_column(t.schema.get_field_index("attributes"), "attributes",
                             pa.ListArray.from_arrays(lists.offsets, attrs))
            t = t.set_column(t.schema.get_field_index("in_degree"), "in_degree", pa.array(indeg[a:a + b]))
            t = t.set_column(t.schema.get_field_index("out_degree"), "out_degree", pa.array(outdeg[a:a + b]))
            ew.write_table(t.cast(ENTITIES_SCHEMA))
    anc = pa.Table.from_pylist(anchors or [], schema=ANCHORS_SCHEMA)
    if anc.num_rows and (pc.min(anc.column("entity_id")).as_py() < 0 or pc.max(anc.column("entity_id")).as_py() >= n):
        raise DataError("an anchor names an unknown entity")
    pq.write_table(anc, root / ".anchors.parquet.tmp", compression="zstd")
    for name in ("entities", "links", "anchors"):
        os.replace(root / f".{name}.parquet.tmp", root / f"{name}.parquet")
    return {"entities": n, "links": n_links, "anchors": anc.num_rows, "eligible_attributes": n_eligible}


def load_kg(root: str | Path | None = None) -> KG:
    """Read a KG folder (default: the committed sample) into a ``KG``.

    Raises ``DataError`` when a table is missing, has the wrong columns, or a link or
    anchor names an entity that does not exist.
    """
    root = Path(root) if root is not None else SAMPLE_DIR
    tables = {}
    for name, schema in (("entities", ENTITIES_SCHEMA), ("links", LINKS_SCHEMA), ("anchors", ANCHORS_SCHEMA)):
        path = root / f"{name}.parquet"
        if not path.is_file():
            raise DataError(f"KG table {path} does not exist (build it with python -m osvl.kg.build_sample)")
        tables[name] = _check_columns(pq.read_table(path), schema, str(path))
    entities: dict[int, dict[str, Any]] = {}
    by_title: dict[str, int] = {}
    by_alias: dict[str, list[int]] = {}
    for row in tables["entities"].to_pylist():
        entities[row["id"]] = row
        by_title.setdefault(fold(row["title"]), row["id"])
    for row in entities.values():
        for a in row["aliases"]:
            k = fold(a)
            if k and by_title.get(k) != row["id"]:
                by_alias.setdefault(k, []).append(row["id"])
    out_links: dict[int, list[tuple[int, str]]] = {}
    in_links: dict[int, list[tuple[int, str]]] = {}
    lnk = tables["links"]
    for s, d, r in zip(
        lnk.column("src").to_pylist(), lnk.column("dst").to_pylist(), lnk.column("relation").to_pylist(), strict=True
    ):
        if s not in entities or d not in entities:
            raise DataError(f"{root}: link {s}->{d} names an unknown entity")
        out_links.setdefault(s, []).append((d, r))
        in_links.setdefault(d, []).append((s, r))
    anchors: dict[int, list[dict[str, Any]]] = {}
    for a in tables["anchors"].to_pylist():
        if a["entity_id"] not in entities:
            raise DataError(f"{root}: anchor {a['image']} names unknown entity {a['entity_id']}")
        anchors.setdefault(a["entity_id"], []).append(a)
    return KG(root, entities, by_title, by_alias, out_links, in_links, anchors)


SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
"""The committed embedded sample (built by ``python -m osvl.kg.build_sample``)."""
