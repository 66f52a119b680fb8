"""The KG compiled once per node into memory-mapped files that every synthesis process shares.

``load_kg`` turns the Parquet tables into Python dicts, and every synthesis worker used to build
its own ``Graph`` from them: a copy of the whole graph per process, so a node's memory grew with
its worker count, not with the data (hundreds of workers over millions of entities). Here the
graph is written once, in forms the operating system can share between processes page by page:

- ``entities.arrow``: one row per usable entity, the fields a walk reads (Arrow IPC file,
  memory-mapped: a row is decoded only when a walk visits it);
- ``ids.npy`` (entity id of each row), ``id_sorted.npy`` + ``row_of_sorted.npy`` (id -> row
  by ``np.searchsorted``), ``in_degree.npy``;
- the adjacency as CSR: ``link_offsets.npy`` (row -> first link), ``link_dst.npy`` (destination
  rows), ``link_rel.npy`` (codes into ``meta.json``'s ``relations``), in the links table's order;
- ``name_hash.npy`` / ``name_row.npy`` (folded title or alias -> rows) and ``value_hash.npy`` /
  ``value_count.npy`` (folded answer value -> how many entities have it): sorted 64-bit hashes,
  not dicts of strings;
- ``anchors.arrow`` (grounded images: a few per seed, read whole) and ``meta.json``.

Every ``.npy`` is opened with ``mmap_mode="r"``: pages come from the page cache, shared by every
process of the node, and count once however many workers read them.

The folder lives under ``cache_root()/kg-compiled/<key>``, the key hashing the tables' paths,
sizes and modification times (a rebuilt KG gets a new folder; hashing gigabytes of content at
every worker start would cost more than it saves) and the caller's variant (``Graph`` bakes its
answer length into the rows). The first process to get there compiles under an ``flock`` into a
temporary folder and renames it into place, so a worker never opens a half-written graph.

What an entity row *means* (which rows are malformed, what its answers are) is the caller's:
``make_entity`` turns a row dict into an object with the fields stored here, and raises on a
row that must be skipped, so that the rules live in one place (``osvl.synth.walks``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl.errors import DataError
from osvl.kg.schema import ANCHORS_SCHEMA, DEFAULT_RELATION, ENTITIES_SCHEMA, LINKS_SCHEMA, fold, name_hash
from osvl.storage import cache_root

VERSION = 1
"""Bumped whenever the layout changes, so that old folders are never opened by new code."""

BATCH = 65_536

PAIRS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))
ROW_SCHEMA = pa.schema([("title", pa.string()), ("aliases", pa.list_(pa.string())), ("description", pa.string()),
                        ("categories", pa.list_(pa.string())), ("attributes", PAIRS), ("answers", PAIRS),
                        ("list_page", pa.bool_())])
ANCHOR_SCHEMA = pa.schema([("entity_id", pa.int64()), ("image", pa.string()), ("caption", pa.string()),
                           ("source", pa.string()), ("licence", pa.string()), ("score", pa.float64()),
                           ("scorer", pa.string())])
ENTITY_COLUMNS = ["id", "title", "aliases", "description", "attributes", "categories", "in_degree", "kind"]


def _pairs(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in pairs]


def compile_graph(out: Path, entity_batches: Iterable[list[dict[str, Any]]],
                  link_batches: Iterable[tuple[np.ndarray, np.ndarray, pa.Array]], anchors: Iterable[dict[str, Any]],
                  make_entity: Callable[[dict[str, Any]], Any], *, strict: bool,
                  count_in_degree: bool = False) -> None:
    """Write the compiled graph into the (empty) folder ``out``.

    ``strict``: a link or anchor naming an id no entity row has is a ``DataError`` (``load_kg``'s rule for
    a KG folder), else it is skipped and counted, as ``Graph`` does for rows it is handed in memory.
    ``count_in_degree``: the rows carry no in-degrees, count the usable links pointing at each entity.
    Entities and links are read batch by batch so that compiling millions stays within a few GiB.
    """
    out.mkdir(parents=True, exist_ok=True)
    bad = {"entity": 0, "link": 0}
    # per batch into numpy at once: Python lists over millions of entities would cost GiBs
    ids, in_degree, every_id, names, name_rows, values = [], [], [], [], [], []
    n = 0
    with pa.OSFile(str(out / "entities.arrow"), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        for rows in entity_batches:
            cols: dict[str, list[Any]] = {f.name: [] for f in ROW_SCHEMA}
            b_ids, b_deg, b_every, b_names, b_rows, b_values = [], [], [], [], [], []
            for row in rows:
                try:
                    b_every.append(int(row["id"]))
                except (KeyError, TypeError, ValueError):
                    pass
                try:
                    ent = make_entity(row)
                except (KeyError, TypeError, ValueError, AttributeError):
                    bad["entity"] += 1  # one broken page must not stop a run over millions
                    continue
                r = n + len(b_ids)
                b_ids.append(ent.id)
                for name in {fold(ent.title), *(fold(a) for a in ent.aliases)}:
                    if name:
                        b_names.append(name_hash(name))
                        b_rows.append(r)
                b_values += [name_hash(fold(v)) for _, v in ent.answers]
                for name in ("title", "aliases", "description", "categories", "list_page"):
                    cols[name].append(getattr(ent, name))
                cols["attributes"].append(_pairs(ent.attributes))
                cols["answers"].append(_pairs(ent.answers))
                b_deg.append(ent.in_degree)
            writer.write_batch(pa.record_batch(cols, schema=ROW_SCHEMA))
            n += len(b_ids)
            ids.append(np.array(b_ids, dtype=np.int64))
            in_degree.append(np.array(b_deg, dtype=np.int64))
            every_id.append(np.array(b_every, dtype=np.int64))
            names.append(np.array(b_names, dtype=np.uint64))
            name_rows.append(np.array(b_rows, dtype=np.int32))
            values.append(np.array(b_values, dtype=np.uint64))
    id_arr = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(np.unique(id_arr)) != n:
        raise DataError("entity ids are not unique")
    order = np.argsort(id_arr, kind="stable")
    np.save(out / "ids.npy", id_arr)
    np.save(out / "id_sorted.npy", id_arr[order])
    np.save(out / "row_of_sorted.npy", order.astype(np.int32))
    # every id a row names, usable or not: a link to a skipped entity is a bad link, not an unknown entity
    known = np.unique(np.concatenate(every_id)) if every_id else np.zeros(0, np.int64)
    known_row = np.full(len(known), -1, dtype=np.int64)
    known_row[np.searchsorted(known, id_arr)] = np.arange(n)
    del ids, every_id

    relations: dict[str, int] = {DEFAULT_RELATION: 0}
    src_rows, dst_rows, rel_codes = [], [], []
    for src, dst, rel in link_batches:
        enc = pc.dictionary_encode(rel)
        # an empty or missing relation is ``linked_to``; the last slot is where missing ones point
        vocab = np.array([relations.setdefault(str(r) if r else DEFAULT_RELATION, len(relations))
                          for r in enc.dictionary.to_pylist()] + [0], dtype=np.int32)
        codes = vocab[enc.indices.fill_null(len(enc.dictionary)).to_numpy()]
        rows = []
        for ends in (src, dst):
            at = np.minimum(np.searchsorted(known, ends), max(len(known) - 1, 0))
            found = known[at] == ends if len(known) else np.zeros(len(ends), bool)
            if strict and not found.all():
                k = int(np.flatnonzero(~found)[0])
                raise DataError(f"link {src[k]}->{dst[k]} names an unknown entity")
            rows.append(np.where(found, known_row[at] if len(known) else -1, -1))
        ok = (rows[0] >= 0) & (rows[1] >= 0) & (src != dst)
        bad["link"] += int((~ok).sum())
        src_rows.append(rows[0][ok].astype(np.int32))
        dst_rows.append(rows[1][ok].astype(np.int32))
        rel_codes.append(codes[ok])
    src_row = np.concatenate(src_rows) if src_rows else np.zeros(0, np.int32)
    dst_row = np.concatenate(dst_rows) if dst_rows else np.zeros(0, np.int32)
    rel = np.concatenate(rel_codes) if rel_codes else np.zeros(0, np.int32)
    del src_rows, dst_rows, rel_codes
    # rows without degrees: count the usable links
    np.save(out / "in_degree.npy", np.bincount(dst_row, minlength=n) if count_in_degree or not in_degree
            else np.concatenate(in_degree))
    by_src = np.argsort(src_row, kind="stable")  # stable: each entity's links keep the table's order
    np.save(out / "link_offsets.npy", np.concatenate([[0], np.cumsum(np.bincount(src_row, minlength=n))]))
    np.save(out / "link_dst.npy", dst_row[by_src])
    np.save(out / "link_rel.npy", rel[by_src])
    del src_row, dst_row, rel, by_src

    name_hashes = np.concatenate(names) if names else np.zeros(0, np.uint64)
    name_row = np.concatenate(name_rows) if name_rows else np.zeros(0, np.int32)
    by_hash = np.lexsort((name_row, name_hashes))  # by hash, then rows in table order
    np.save(out / "name_hash.npy", name_hashes[by_hash])
    np.save(out / "name_row.npy", name_row[by_hash])
    del names, name_rows, name_hashes, name_row, by_hash
    value_hash, value_count = np.unique(np.concatenate(values) if values else np.zeros(0, np.uint64),
                                        return_counts=True)
    np.save(out / "value_hash.npy", value_hash)
    np.save(out / "value_count.npy", value_count.astype(np.int64))

    kept = []
    for a in anchors:
        eid = int(a["entity_id"])
        at = int(np.searchsorted(known, eid))
        if at == len(known) or known[at] != eid:
            if strict:
                raise DataError(f"anchor {a['image']} names unknown entity {eid}")
            continue
        if known_row[at] >= 0:
            kept.append({"entity_id": eid, "image": str(a["image"]), "caption": str(a.get("caption") or ""),
                         "source": str(a.get("source") or ""), "licence": str(a.get("licence") or ""),
                         "score": float(a.get("score") or 0.0), "scorer": str(a.get("scorer") or "")})
    with pa.OSFile(str(out / "anchors.arrow"), "wb") as sink, pa.ipc.new_file(sink, ANCHOR_SCHEMA) as writer:
        writer.write_table(pa.Table.from_pylist(kept, schema=ANCHOR_SCHEMA))
    meta = {"version": VERSION, "entities": n, "links": int(len(np.load(out / "link_dst.npy", mmap_mode="r"))),
            "relations": list(relations), "bad": bad, "compiled_by": os.getpid()}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: a folder without it is partial


def _table_batches(path: Path, schema: pa.Schema, columns: list[str]) -> Iterator[pa.Table]:
    """``columns`` of a KG table, batch by batch, cast to the KG schema (``load_kg``'s checks, streamed)."""
    if not path.is_file():
        raise DataError(f"KG table {path} does not exist (build it with python -m osvl.kg.build_sample)")
    have = pq.read_schema(path).names
    missing = [c for c in schema.names if c not in have]
    if missing:
        raise DataError(f"{path}: missing columns {missing}")
    want = pa.schema([schema.field(c) for c in columns])
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=columns):
        try:
            yield pa.Table.from_batches([batch]).cast(want)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise DataError(f"{path}: columns do not match the KG schema: {e}") from e


def _int64(col: pa.ChunkedArray) -> np.ndarray:
    return pc.fill_null(col, np.iinfo(np.int64).min).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def compile_folder(root: Path, out: Path, make_entity: Callable[[dict[str, Any]], Any]) -> None:
    """Compile a KG folder's three Parquet tables into ``out``."""
    entity_batches = (b.to_pylist() for b in _table_batches(root / "entities.parquet", ENTITIES_SCHEMA,
                                                              ENTITY_COLUMNS))
    link_batches = ((_int64(b.column("src")), _int64(b.column("dst")), b.column("relation").combine_chunks())
                    for b in _table_batches(root / "links.parquet", LINKS_SCHEMA, LINKS_SCHEMA.names))
    anchors = [r for b in _table_batches(root / "anchors.parquet", ANCHORS_SCHEMA, ANCHORS_SCHEMA.names)
               for r in b.to_pylist()]
    compile_graph(out, entity_batches, link_batches, anchors, make_entity, strict=True)


def folder_key(root: Path, variant: str) -> str:
    """The cache key of a KG folder: the tables' paths, sizes and modification times, and ``variant``."""
    digest = hashlib.sha256(f"v{VERSION}\x1f{variant}".encode())
    for name in ("entities.parquet", "links.parquet", "anchors.parquet"):
        path = (root / name).resolve()
        st = path.stat() if path.is_file() else None
        digest.update(f"\x1f{path}\x1f{st.st_size if st else -1}\x1f{st.st_mtime_ns if st else -1}".encode())
    return digest.hexdigest()[:20]


def ensure(root: str | Path, make_entity: Callable[[dict[str, Any]], Any], variant: str = "") -> Path:
    """The compiled folder of the KG at ``root``, compiling it first if no process of this node has."""
    root = Path(root)
    base = cache_root() / "kg-compiled"
    folder = base / folder_key(root, variant)
    if (folder / "meta.json").is_file():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then find the folder done
        try:
            if not (folder / "meta.json").is_file():
                tmp = base / f".{folder.name}.{os.getpid()}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    compile_folder(root, tmp, make_entity)
                    shutil.rmtree(folder, ignore_errors=True)  # a partial folder from a crash before rename
                    os.rename(tmp, folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


class CompiledGraph:
    """An opened compiled folder: row lookups over the shared mappings; nothing here copies the graph."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        if self.meta["version"] != VERSION:
            raise DataError(f"{self.folder} was compiled by another osvl version; delete it to recompile")
        self.table = pa.ipc.open_file(pa.memory_map(str(self.folder / "entities.arrow"))).read_all()
        arr = {p.stem: np.load(p, mmap_mode="r") for p in self.folder.glob("*.npy")}
        self.ids, self.id_sorted, self.row_of_sorted = arr["ids"], arr["id_sorted"], arr["row_of_sorted"]
        self.in_degree, self.offsets, self.dst, self.rel = (arr["in_degree"], arr["link_offsets"], arr["link_dst"],
                                                            arr["link_rel"])
        self.name_hash, self.name_row = arr["name_hash"], arr["name_row"]
        self.value_hash, self.value_counts = arr["value_hash"], arr["value_count"]
        self.relations: list[str] = self.meta["relations"]
        self.anchors = pa.ipc.open_file(pa.memory_map(str(self.folder / "anchors.arrow"))).read_all().to_pylist()

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, eid: int) -> int:
        """The row of entity ``eid``, -1 when the graph has none."""
        at = int(np.searchsorted(self.id_sorted, eid))
        return int(self.row_of_sorted[at]) if at < len(self.id_sorted) and self.id_sorted[at] == eid else -1

    def rows(self, eids: np.ndarray) -> np.ndarray:
        """``row`` for many ids at once."""
        at = np.minimum(np.searchsorted(self.id_sorted, eids), max(len(self.id_sorted) - 1, 0))
        hit = self.id_sorted[at] == eids if len(self.id_sorted) else np.zeros(len(eids), bool)
        return np.where(hit, self.row_of_sorted[at] if len(self.id_sorted) else -1, -1)

    def record(self, row: int) -> dict[str, Any]:
        """Row ``row`` of ``entities.arrow`` as a dict, plus its id and in-degree."""
        rec = self.table.slice(row, 1).to_pylist()[0]
        rec.update(id=int(self.ids[row]), in_degree=int(self.in_degree[row]))
        return rec

    def links(self, row: int) -> list[tuple[int, str]]:
        """(destination id, relation) of each link leaving ``row``, in the links table's order."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        return list(zip(self.ids[self.dst[a:b]].tolist(), [self.relations[c] for c in self.rel[a:b].tolist()],
                        strict=True))

    def named(self, name: str) -> list[int]:
        """Rows whose folded title or alias hashes like the folded ``name`` (the caller checks the strings)."""
        h = np.uint64(name_hash(name))
        a, b = np.searchsorted(self.name_hash, h, "left"), np.searchsorted(self.name_hash, h, "right")
        return self.name_row[a:b].tolist()

    def value_count(self, value: str) -> int:
        """How many answers fold to ``value`` (a hash collision, about 3 in 10^8 for a million distinct
        values, would merge two counts: it only reweights which answer a walk picks)."""
        h = np.uint64(name_hash(value))
        at = int(np.searchsorted(self.value_hash, h))
        return int(self.value_counts[at]) if at < len(self.value_hash) and self.value_hash[at] == h else 0
