"""Wikidata -> KG Parquet tables, on Ray Data (``jobs/build_kg.py --format=wikidata_json|wikidata_triples``).

Two input formats:

- **JSON dump** (``latest-all.json.bz2`` from dumps.wikimedia.org, or any extract of
  it): a JSON array with one entity per line (``[``, ``{...},`` lines, ``]``); JSON Lines
  (one entity per line, no commas) read the same. Items become entities (English label as
  title, aliases, description); property entities in the same file give the relation
  names, with ``PROPERTY_LABELS`` for the common ones a small extract lacks.
- **Triples**: a text file of ``subject, property, object`` rows (tab-separated for
  ``.tsv``, else comma-separated; a ``subject,property,object`` header is skipped; the
  Query Service's entity URIs are read as their ids, so its CSV output loads as is), with
  a label table (``--labels``: ``id, label[, description[, aliases]]`` rows, same delimiter
  rule; aliases separated by ``|``, as the Query Service's ``GROUP_CONCAT(?alt; separator="|")``
  writes them) naming the ids. An object that is a subject, or has a label and looks like an item id
  (``Q42``), is an entity; anything else is a literal.

What a claim becomes:
- object is an entity -> a link; its relation is the property *label* ("place of birth"),
  which is what the question grammar (``osvl.synth.phrasing``) words, and a walk may end by
  asking for that entity ("the country of ...": ``osvl.synth.walks``, entity answers). The
  claim is also an attribute that is never an answer string (``eligible`` false), so the
  entity's page shows it ("place of birth: Lyon."), where a reader finds the answer;
- ``P31`` (instance of) targets also become categories ("human", "city"): readable words
  that the rewriter can use as descriptors;
- ``P18`` (image) -> an image name, kept as a name; with ``--images_dir`` a file of that
  name becomes an anchor photo (score 1.0, scorer ``wikidata_p18``: the P18 statement is
  the community's claim that the photo shows the item), licence read from the folder's
  Debian-copyright-style ``README`` (an anchor without a licence is never used);
- a literal (time, quantity, string, monolingual text) -> an attribute named by the
  property label; identifiers, URLs and coordinates are not facts a question asks for and
  are dropped, as is any claim whose property has no label (counted).

Ray Data reads the file line by line and parses lines on workers; their rows stream to a parquet
file beside the output, and ``build`` joins them in bounded pieces: Arrow kernels map ids to row
numbers and properties and units to labels batch by batch, every claim's output goes to files by
entity-id range, and each range is assembled and appended alone. The driver keeps one Arrow column
per entity (ids, titles, descriptions, aliases) and the degree arrays, no Python object per entity:
a 1 GB triples file of 2 M items builds within 2 GiB (docs/measurements.md, bench/kg_scale.py).
"""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl.errors import DataError
from osvl.kg.anchors import read_licences
from osvl.kg.schema import ATTRIBUTE_TYPE, ENTITIES_SCHEMA, LINKS_SCHEMA, write_kg_parts

logger = logging.getLogger(__name__)

FORMATS = ("wikidata_json", "wikidata_triples")
IMAGE_PROPERTY, INSTANCE_OF = "P18", "P31"

PROPERTY_LABELS = {
    "P17": "country", "P18": "image", "P19": "place of birth", "P20": "place of death", "P27": "country of citizenship",
    "P30": "continent", "P31": "instance of", "P36": "capital", "P47": "shares border with", "P50": "author",
    "P57": "director", "P69": "educated at", "P84": "architect", "P106": "occupation", "P108": "employer",
    "P112": "founded by", "P119": "place of burial", "P127": "owned by", "P131": "located in the administrative "
    "territorial entity", "P135": "movement", "P136": "genre", "P138": "named after", "P149": "architectural style",
    "P150": "contains the administrative territorial entity", "P155": "follows", "P156": "followed by",
    "P159": "headquarters location", "P170": "creator", "P171": "parent taxon", "P180": "depicts",
    "P186": "made from material", "P206": "located in or next to body of water", "P276": "location",
    "P279": "subclass of", "P361": "part of", "P403": "mouth of the watercourse", "P463": "member of",
    "P527": "has part", "P569": "date of birth", "P570": "date of death", "P571": "inception",
    "P577": "publication date", "P706": "located on terrain feature", "P1082": "population",
    "P1376": "capital of", "P1448": "official name", "P2044": "elevation above sea level", "P2046": "area",
    "P2048": "height", "P225": "taxon name", "P105": "taxon rank", "P1435": "heritage designation",
}
# Not facts to ask about: identifiers, links, coordinates, media other than P18.
SKIP_DATATYPES = {"external-id", "url", "globe-coordinate", "commonsMedia", "geo-shape", "tabular-data", "math",
                  "musical-notation", "wikibase-property", "wikibase-lexeme", "wikibase-form", "wikibase-sense"}
SKIP_PROPERTIES = {"P373", "P910", "P856", "P625", "P935", "P1151"}  # Commons/topic categories, website, coords
UNITS = {"Q11573": "metres", "Q828224": "kilometres", "Q712226": "square kilometres", "Q11570": "kilograms",
         "Q3207456": "square metres", "Q174728": "centimetres", "Q3710": "feet", "Q11229": "percent"}
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
_ITEM_ID = re.compile(r"^Q\d+$")
_PROPERTY_ID = re.compile(r"^P\d+$")


def format_time(value: dict[str, Any]) -> str:
    """Wikidata time -> words at its precision: "31 March 1889", "March 1889", "1889", "500 BC"."""
    m = re.match(r"^([+-])(\d+)-(\d\d)-(\d\d)", str(value.get("time", "")))
    if not m:
        raise DataError(f"unparsable Wikidata time {value!r}")
    sign, year, month, day = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
    era = " BC" if sign == "-" else ""
    precision = int(value.get("precision", 9))
    if precision >= 11 and month and day:
        return f"{day} {MONTHS[month - 1]} {year}{era}"
    if precision == 10 and month:
        return f"{MONTHS[month - 1]} {year}{era}"
    return f"{year}{era}"


def format_quantity(value: dict[str, Any]) -> tuple[str, str]:
    """(amount, unit id or ""): "+2148000" -> "2148000"; the unit is named once every label is known."""
    amount = str(value.get("amount", "")).lstrip("+")
    if not re.match(r"^-?\d+(\.\d+)?$", amount):
        raise DataError(f"unparsable Wikidata quantity {value!r}")
    unit = str(value.get("unit", "1")).rsplit("/", 1)[-1]
    return amount, unit if _ITEM_ID.match(unit) else ""


def _text(field: dict[str, Any], language: str) -> str:
    entry = (field or {}).get(language) or {}
    return str(entry.get("value", "")) if isinstance(entry, dict) else ""


def parse_entity(line: str, language: str = "en") -> dict[str, Any] | None:
    """One line of a JSON dump -> a record (None for the array brackets and blank lines).

    Records: ``{id, type, label, description, aliases, datatype, claims}``, each claim
    ``{property, kind, value, unit}`` with kind ``item`` (value = target id), ``image``,
    ``literal`` or ``skip`` (kept only to be counted). Raises ``DataError`` on bad JSON.
    """
    text = line.strip().rstrip(",")
    if not text or text in ("[", "]"):
        return None
    try:
        obj = json.loads(text)
        eid, kind = str(obj["id"]), str(obj.get("type", "item"))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"not a Wikidata entity: {text[:80]!r} ({e})") from e
    claims = []
    for prop, statements in (obj.get("claims") or {}).items():
        for st in statements or []:
            snak = (st or {}).get("mainsnak") or {}
            dv, dtype = snak.get("datavalue") or {}, snak.get("datatype", "")
            if snak.get("snaktype", "value") != "value" or not dv or st.get("rank") == "deprecated":
                continue
            value, vtype = dv.get("value"), dv.get("type")
            claim = {"property": prop, "kind": "skip", "value": "", "unit": ""}
            try:
                if prop == IMAGE_PROPERTY and isinstance(value, str):
                    claim.update(kind="image", value=value)
                elif prop in SKIP_PROPERTIES or dtype in SKIP_DATATYPES:
                    pass
                elif vtype == "wikibase-entityid":
                    claim.update(kind="item", value=str(value.get("id") or f"Q{value['numeric-id']}"))
                elif vtype == "time":
                    claim.update(kind="literal", value=format_time(value))
                elif vtype == "quantity":
                    amount, unit = format_quantity(value)
                    claim.update(kind="literal", value=amount, unit=unit)
                elif vtype == "monolingualtext" and value.get("language") == language:
                    claim.update(kind="literal", value=str(value.get("text", "")))
                elif vtype == "string":
                    claim.update(kind="literal", value=value)
            except (DataError, KeyError, TypeError, AttributeError):
                claim["kind"] = "skip"  # one odd value must not lose the entity
            claims.append(claim)
    return {"id": eid, "type": kind, "label": _text(obj.get("labels"), language),
            "description": _text(obj.get("descriptions"), language),
            "aliases": [str(a.get("value", "")) for a in (obj.get("aliases") or {}).get(language) or []],
            "datatype": str(obj.get("datatype", "")), "claims": claims}


def _bare(cell: str) -> str:
    """``http://www.wikidata.org/entity/Q90`` (as the Query Service writes CSV) -> ``Q90``."""
    cell = cell.strip()
    return cell.rsplit("/", 1)[-1] if cell.startswith(("http://www.wikidata.org/", "https://www.wikidata.org/")) \
        else cell


def parse_triple(line: str, delimiter: str) -> tuple[str, str, str] | None:
    """One ``subject, property, object`` row (None for blanks and the header); ``DataError`` when not three fields."""
    if not line.strip():
        return None
    row = next(csv.reader([line], delimiter=delimiter))
    if len(row) != 3 or not all(x.strip() for x in row):
        raise DataError(f"not a subject, property, object row: {line[:80]!r}")
    s, p, o = (_bare(x) for x in row)
    return None if (s.lower(), p.lower(), o.lower()) == ("subject", "property", "object") else (s, p, o)


# One table for everything a line parses into, so Ray Data's workers hand the driver Arrow batches it writes
# straight to disk: a claim row per claim, an entity row per JSON entity (its label, description, aliases),
# an error row per bad line. ``k`` orders a JSON entity's claims as its line lists them.
PARSED = pa.schema([("rtype", pa.string()), ("s", pa.string()), ("p", pa.string()), ("kind", pa.string()),
                    ("value", pa.string()), ("unit", pa.string()), ("k", pa.int32()), ("etype", pa.string()),
                    ("label", pa.string()), ("description", pa.string()), ("aliases", pa.list_(pa.string())),
                    ("error", pa.string())])


def _parse_batch(batch: dict[str, Any], fmt: str, language: str, delimiter: str) -> pa.Table:
    """Ray Data ``map_batches``: lines -> ``PARSED`` rows."""
    rows: list[dict[str, Any]] = []
    for line in batch["text"]:
        try:
            if fmt == "wikidata_json":
                rec = parse_entity(line, language)
                if rec is None:
                    continue
                rows.append({"rtype": "entity", "s": rec["id"], "etype": rec["type"], "label": rec["label"],
                             "description": rec["description"], "aliases": rec["aliases"]})
                rows += [{"rtype": "claim", "s": rec["id"], "p": c["property"], "kind": c["kind"], "value": c["value"],
                          "unit": c["unit"], "k": k} for k, c in enumerate(rec["claims"])]
            elif (t := parse_triple(line, delimiter)) is not None:
                rows.append({"rtype": "claim", "s": t[0], "p": t[1], "kind": "", "value": t[2], "unit": "", "k": 0})
        except DataError as e:
            rows.append({"rtype": "error", "error": str(e)[:200]})
    return pa.Table.from_pylist(rows, schema=PARSED)


RANGE_BYTES = 32 << 20


def _parse_range(batch: dict[str, Any], path: str, fmt: str, language: str, delimiter: str) -> pa.Table:
    """Ray Data ``map_batches`` over byte ranges: the lines that start in ``[start, end)`` of ``path``, parsed."""
    tables = []
    with open(path, "rb") as f:
        for start, end in zip(batch["start"].tolist(), batch["end"].tolist(), strict=True):
            f.seek(max(0, start - 1))
            if start > 0:
                f.readline()  # the line under way at start - 1 belongs to the range before
            lines = []
            while f.tell() < end and (line := f.readline()):
                lines.append(line.decode("utf-8", errors="replace"))
            tables.append(_parse_batch({"text": lines}, fmt, language, delimiter))
    return pa.concat_tables(tables)


def _label_table(path: Path | None, chunk: int = 100_000) -> pa.Table:
    """The triples' label table (``id, label[, description[, aliases]]`` rows, aliases ``|``-separated; rows may
    have fewer cells) as Arrow columns id, label, description, aliases, read ``chunk`` rows at a time (a Python
    row per entity would not fit beside a full extract's millions)."""
    names = ("id", "label", "description", "aliases")
    pieces: list[pa.Table] = []
    cells: list[list[str]] = []

    def flush() -> None:
        cols = list(zip(*cells, strict=True)) if cells else [()] * 4
        pieces.append(pa.table({"id": pa.array(cols[0], pa.string()), "label": pa.array(cols[1], pa.string()),
                                "description": pa.array(cols[2], pa.string()),
                                "aliases": pa.array([[a.strip() for a in c.split("|") if a.strip()] for c in cols[3]],
                                                    pa.list_(pa.string()))}))
        cells.clear()

    if path is not None:
        with path.open(encoding="utf-8", newline="") as f:
            for row in csv.reader(f, delimiter="\t" if path.suffix == ".tsv" else ","):
                if not row:
                    continue
                row = [_bare(row[0]), *(c.strip() for c in row[1:4])] + [""] * (4 - min(4, len(row)))
                if row[0].lower() != "id":
                    cells.append(row[:4])
                if len(cells) >= chunk:
                    flush()
    flush()
    return pa.concat_tables(pieces).select(list(names))


def _order_ids(ids: pa.Array) -> pa.Array:
    """Distinct item ids in the order entity ids are given ((length, id): Q2 before Q10), whatever order Ray Data
    handed the lines back in."""
    ids = pc.unique(ids)
    t = pa.table({"n": pc.utf8_length(ids), "id": ids})
    return t.take(pc.sort_indices(t, [("n", "ascending"), ("id", "ascending")])).column("id").combine_chunks()


class _Parts:
    """Rows of one kind (links, attributes, ...) written to parquet files by entity-id range, so each range is
    read back alone (bounded memory) when its entities are assembled."""

    def __init__(self, folder: Path, span: int) -> None:
        self.folder, self.span, self.writers = folder, span, {}
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, t: pa.Table) -> None:
        if t.num_rows == 0:
            return
        part = pc.divide(t.column("src"), self.span)
        for k in pc.unique(part).to_pylist():
            piece = t.filter(pc.equal(part, k))
            if k not in self.writers:
                self.writers[k] = pq.ParquetWriter(self.folder / f"{k:06d}.parquet", piece.schema)
            self.writers[k].write_table(piece)

    def peek(self, k: int) -> pa.Table | None:
        """Range ``k``'s rows (after ``close``)."""
        f = self.folder / f"{k:06d}.parquet"
        return pq.read_table(f) if f.is_file() else None

    def read(self, k: int) -> pa.Table | None:
        """Range ``k``'s rows, for the last time: the file is deleted (disk holds one copy of the claims)."""
        t = self.peek(k)
        (self.folder / f"{k:06d}.parquet").unlink(missing_ok=True)
        return t

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers = {}


def _lists(t: pa.Table | None, lo: int, n: int, column: str, dtype: pa.DataType) -> pa.Array:
    """``column`` of ``t`` (rows of entities ``lo .. lo + n - 1``, by ``src``) as one list per entity, each in the
    order of ``t``'s other columns (the claims' order); [] for an entity without rows."""
    if t is None or t.num_rows == 0:
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], dtype))
    order = [c for c in t.column_names if c not in ("src", column)]
    t = t.sort_by([("src", "ascending"), *((c, "ascending") for c in order)])
    offsets = np.searchsorted(t.column("src").to_numpy(), np.arange(lo, lo + n + 1)).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), t.column(column).combine_chunks().cast(dtype))


def _claims(parsed: pq.ParquetFile, fmt: str, ids: pa.Array, label_of: pa.Array, prop_label: dict[str, str],
            parts: dict[str, _Parts], counts: Counter[str]) -> None:
    """Every claim row, batch by batch, into the parts: links (item claims), categories (``instance of``
    targets), attributes (literals, and item claims shown by their target's label, never an answer string),
    images (P18). Each keeps its claim-order columns (sorted triples: property then object; a JSON entity's
    line order ``k``), so an entity's lists come out as the former per-record assembly made them."""
    keys, vals = pa.array(list(prop_label), pa.string()), pa.array(list(prop_label.values()), pa.string())
    unit_keys, unit_vals = pa.array(list(UNITS), pa.string()), pa.array(list(UNITS.values()), pa.string())
    for b in parsed.iter_batches(batch_size=1 << 20, columns=["rtype", "s", "p", "kind", "value", "unit", "k"]):
        t = pa.Table.from_batches([b])
        t = t.filter(pc.equal(t.column("rtype"), "claim"))
        src = pc.index_in(t.column("s"), value_set=ids)
        t = t.append_column("src", src).filter(pc.is_valid(src))  # a property entity's own claims: none kept
        p, value = t.column("p"), t.column("value")
        dst = pc.index_in(value, value_set=ids)
        if fmt == "wikidata_triples":  # an object that is a known item is an entity; anything else a literal
            kind = pc.if_else(pc.is_in(p, pa.array([IMAGE_PROPERTY, "image"])), "image",
                              pc.if_else(pc.is_valid(dst), "item", "literal"))
            order = {"p": p, "o": value}
        else:
            kind, order = t.column("kind"), {"k": t.column("k")}
        rel = pc.coalesce(pc.take(vals, pc.index_in(p, value_set=keys)),
                          pc.if_else(pc.match_substring_regex(p, r"^P\d+$"), "", p))
        t = pa.table({"src": t.column("src"), **order, "p": p, "value": value, "unit": t.column("unit"),
                      "kind": kind, "rel": rel, "dst": dst})
        counts["claim_not_a_fact"] += int(pc.sum(pc.equal(kind, "skip")).as_py() or 0)
        images = t.filter(pc.equal(kind, "image"))
        parts["images"].write(images.select(["src", *order, "value"]))
        t = t.filter(pc.and_(pc.not_equal(kind, "skip"), pc.not_equal(kind, "image")))
        unlabelled = pc.equal(t.column("rel"), "")
        counts["claim_unlabelled_property"] += int(pc.sum(unlabelled).as_py() or 0)
        t = t.filter(pc.invert(unlabelled))
        items = t.filter(pc.equal(t.column("kind"), "item"))
        missing = pc.is_null(items.column("dst"))
        counts["link_to_missing_item"] += int(pc.sum(missing).as_py() or 0)
        items = items.filter(pc.invert(missing))
        parts["links"].write(items.select(["src", *order, "dst", "rel"]))
        target = pc.take(label_of, items.column("dst"))
        is_class = pc.is_in(items.column("p"), pa.array([INSTANCE_OF, "instance of"]))
        labelled = pc.not_equal(target, "")
        cats = items.filter(pc.and_(is_class, labelled))
        parts["categories"].write(cats.select(["src", *order]).append_column(
            "category", pc.take(label_of, cats.column("dst"))))
        shown = items.filter(pc.and_(pc.invert(is_class), labelled))  # "country: France." on the page
        lits = t.filter(pc.equal(t.column("kind"), "literal"))
        unit = pc.fill_null(pc.coalesce(pc.take(unit_vals, pc.index_in(lits.column("unit"), value_set=unit_keys)),
                                        pc.take(label_of, pc.index_in(lits.column("unit"), value_set=ids))), "")
        lit_text = pc.utf8_trim_whitespace(pc.binary_join_element_wise(lits.column("value"), unit, " "))
        # source: the claim as stated (the item's id for an item claim, the value with its unit for a literal)
        for rows, text, stated, never in ((shown, pc.take(label_of, shown.column("dst")), shown.column("value"), True),
                                          (lits, lit_text, lit_text, False)):
            parts["attributes"].write(rows.select(["src", *order]).append_column("key", rows.column("rel"))
                                      .append_column("text", text)
                                      .append_column("source", pc.binary_join_element_wise(rows.column("p"), stated,
                                                                                            ": "))
                                      .append_column("never", pa.array([never] * rows.num_rows, pa.bool_())))


def _entity_part(parts: dict[str, _Parts], k: int, lo: int, hi: int, cols: dict[str, pa.Array]) -> pa.Table:
    """Entities ``lo .. hi - 1`` for ``write_kg_parts``: an item claim shown on the page is never an answer string
    (``eligible`` false); a literal's eligibility is the writer's rule (null)."""
    at = parts["attributes"].read(k)
    if at is not None:
        never = at.column("never").to_numpy(zero_copy_only=False)
        attr = pa.StructArray.from_arrays([at.column("key").combine_chunks(), at.column("text").combine_chunks(),
                                           at.column("source").combine_chunks(),
                                           pa.array([False if x else None for x in never.tolist()], pa.bool_())],
                                          fields=list(ATTRIBUTE_TYPE))
        at = at.drop_columns(["key", "text", "source", "never"]).append_column("attr", attr)
    aliases = [[a for a in (al or []) if a] for al in cols["aliases"][lo:hi].to_pylist()]
    zeros = pa.array(np.zeros(hi - lo, np.int32))
    return pa.table({
        "id": pa.array(np.arange(lo, hi), pa.int64()), "title": cols["title"][lo:hi],
        "aliases": pa.array(aliases, pa.list_(pa.string())), "description": cols["description"][lo:hi],
        "text": cols["description"][lo:hi], "attributes": _lists(at, lo, hi - lo, "attr", ATTRIBUTE_TYPE),
        "images": _lists(parts["images"].peek(k), lo, hi - lo, "value", pa.string()),
        "categories": _lists(parts["categories"].read(k), lo, hi - lo, "category", pa.string()),
        "in_degree": zeros, "out_degree": zeros, "kind": cols["kind"][lo:hi],
        "origin": pa.array(["wikidata"] * (hi - lo))}, schema=ENTITIES_SCHEMA)


def build(path: Path, fmt: str, kg_dir: Path, *, labels: Path | None = None, images_dir: Path | None = None,
          language: str = "en", workers: int = 2, log: Callable[[str], None] = logger.info,
          part_entities: int = 200_000) -> dict[str, Any]:
    """Parse ``path`` on Ray Data and write the KG tables into ``kg_dir``; returns counts.

    Nothing per entity is held as Python objects: the parsed rows stream from Ray Data to a parquet file
    beside the output, the joins (ids to row numbers, property and unit labels) run as Arrow kernels over
    batches, each claim's output (links, attributes, categories, images) goes to files by entity-id range,
    and each range of ``part_entities`` entities is assembled and appended to the tables alone. What stays
    whole is one Arrow column per entity (ids, titles, descriptions, aliases, kinds) and the degree arrays:
    bytes, not objects (docs/measurements.md has a 1 GB triples file).
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/build_kg.py --help

    if fmt not in FORMATS:
        raise DataError(f"unknown Wikidata format {fmt!r}; one of {FORMATS}")
    ray.data.DataContext.get_current().enable_progress_bars = False
    delimiter = "\t" if ".tsv" in path.suffixes else ","
    kg_dir.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(dir=kg_dir, prefix=".build-") as tmp_name:
        tmp = Path(tmp_name)
        kwargs = {"fmt": fmt, "language": language, "delimiter": delimiter}
        if path.suffix in (".bz2", ".gz"):  # a compressed stream has no random access: Ray Data reads it whole
            ds = ray.data.read_text(str(path), override_num_blocks=max(1, workers))
            ds = ds.map_batches(_parse_batch, fn_kwargs=kwargs, batch_format="numpy", num_cpus=1)
        else:  # byte ranges of RANGE_BYTES, each read and parsed by one task (read_text held 6 GB of one file's lines)
            size = path.stat().st_size
            ds = ray.data.from_items([{"start": lo, "end": min(size, lo + RANGE_BYTES)}
                                      for lo in range(0, max(size, 1), RANGE_BYTES)])
            ds = ds.map_batches(_parse_range, fn_kwargs={"path": str(path), **kwargs}, batch_size=1,
                                batch_format="numpy", num_cpus=1)
        with pq.ParquetWriter(tmp / "parsed.parquet", PARSED) as w:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=65_536):
                w.write_table(batch.cast(PARSED))
        parsed = pq.ParquetFile(tmp / "parsed.parquet")

        def batches(rtype: str, columns: list[str]) -> Iterator[pa.Table]:
            for b in parsed.iter_batches(batch_size=1 << 20, columns=["rtype", *columns]):
                t = pa.Table.from_batches([b])
                yield t.filter(pc.equal(t.column("rtype"), rtype))

        def rows(rtype: str, columns: list[str]) -> pa.Table:
            return pa.concat_tables(list(batches(rtype, columns)) or [PARSED.empty_table().select(["rtype", *columns])])

        bad = rows("error", ["error"]).column("error")
        prop_label = dict(PROPERTY_LABELS)
        if fmt == "wikidata_json":
            ents = rows("entity", ["s", "etype", "label", "description", "aliases"])
            props = ents.filter(pc.equal(ents.column("etype"), "property"))
            prop_label.update({i: lab for i, lab in zip(props.column("s").to_pylist(),
                                                        props.column("label").to_pylist(), strict=True) if lab})
            ents = ents.filter(pc.equal(ents.column("etype"), "item")).rename_columns(
                ["rtype", "id", "etype", "label", "description", "aliases"])
            ids = _order_ids(ents.column("id"))
            log(f"build_kg: {ents.num_rows} entities parsed, {len(bad)} bad lines skipped")
        else:
            ents = _label_table(labels)
            prop_label.update({i: lab for i, lab in zip(ents.column("id").to_pylist(),
                                                        ents.column("label").to_pylist(), strict=True)
                               if lab and _PROPERTY_ID.match(i)})
            # items: the subjects, and the objects that are subjects or labelled Q-ids (two passes, a batch at a time)
            subjects = pc.unique(pa.chunked_array([pc.unique(t.column("s")) for t in batches("claim", ["s"])],
                                                  pa.string()))
            labelled = ents.column("id").filter(pc.match_substring_regex(ents.column("id"), r"^Q\d+$"))
            objects, n_triples = [], 0
            for t in batches("claim", ["value"]):
                o = t.column("value")
                objects.append(pc.unique(o.filter(pc.or_(pc.is_in(o, subjects), pc.is_in(o, labelled)))))
                n_triples += t.num_rows
            ids = _order_ids(pa.chunked_array([subjects, *objects], pa.string()))
            log(f"build_kg: {n_triples} triples parsed, {len(bad)} bad lines skipped")
            del objects
        n = len(ids)
        at = pc.index_in(ids, value_set=ents.column("id"))  # each entity's row of the label / entity table
        label_of = pc.fill_null(pc.take(ents.column("label"), at), "")  # "" where an entity has no label
        counts["unlabelled_entity"] = int(pc.sum(pc.equal(label_of, "")).as_py() or 0)
        description = pc.fill_null(pc.take(ents.column("description"), at), "")
        desc = pc.utf8_lower(description)
        cols = {"title": pc.if_else(pc.equal(label_of, ""), ids, label_of), "description": description,
                "aliases": pc.take(ents.column("aliases"), at),
                "kind": pc.if_else(pc.match_substring(desc, "disambiguation page"), "disambiguation",
                                   pc.if_else(pc.match_substring(desc, "list article"), "list", "article"))}
        del ents, desc

        span = max(1, part_entities)
        n_parts = (n + span - 1) // span
        parts = {name: _Parts(tmp / name, span) for name in ("links", "attributes", "categories", "images")}
        _claims(parsed, fmt, ids, label_of, prop_label, parts, counts)
        for part in parts.values():
            part.close()
        licences = read_licences(images_dir) if images_dir else {}
        if images_dir is not None and kg_dir.joinpath("images").is_dir():
            shutil.rmtree(kg_dir / "images")  # a rebuild must not keep photos of a former input
        anchors: list[dict[str, Any]] = []
        written = []  # (entities, links) part files in id order, for the writer's two passes
        for k in range(n_parts):
            lo, hi = k * span, min(n, (k + 1) * span)
            ent_file, link_file = tmp / f"entities-{k:06d}.parquet", tmp / f"links-{k:06d}.parquet"
            lk = parts["links"].read(k)
            if lk is not None:  # in claim order; the writer keeps one of each (src, dst, relation)
                order = [c for c in lk.column_names if c not in ("src", "dst", "rel")]
                lk = lk.sort_by([("src", "ascending"), *((c, "ascending") for c in order)])
                pq.write_table(pa.table({"src": lk.column("src").cast(pa.int64()),
                                         "dst": lk.column("dst").cast(pa.int64()), "relation": lk.column("rel")},
                                        schema=LINKS_SCHEMA), link_file)
            imgs = parts["images"].peek(k)
            pq.write_table(_entity_part(parts, k, lo, hi, cols), ent_file)
            written.append((ent_file, link_file))
            for i, name in zip(imgs.column("src").to_pylist() if imgs is not None and images_dir else [],
                               imgs.column("value").to_pylist() if imgs is not None and images_dir else [],
                               strict=True):
                a = _anchor(images_dir, kg_dir, i, name, cols["title"][i].as_py(), description[i].as_py(), licences)
                if a is not None:
                    anchors.append(a)
        report = write_kg_parts(kg_dir, written, anchors)
    return {**report, "bad_lines": len(bad), "bad_examples": bad.slice(0, 5).to_pylist(), **dict(counts)}


def _anchor(images_dir: Path, kg_dir: Path, eid: int, name: str, title: str, description: str,
            licences: dict[str, str]) -> dict[str, Any] | None:
    """An anchor photo for entity ``eid`` when ``images_dir`` holds a file of the P18 name (copied into the KG)."""
    src = next((images_dir / n for n in (name, name.replace(" ", "_")) if (images_dir / n).is_file()), None)
    if src is None:
        return None
    (kg_dir / "images").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, kg_dir / "images" / src.name)
    return {"entity_id": eid, "image": src.name, "caption": f"{title}: {description}",
            "source": f"wikidata {IMAGE_PROPERTY}", "licence": licences.get(src.name, ""), "score": 1.0,
            "scorer": "wikidata_p18"}
