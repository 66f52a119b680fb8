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

Ray Data reads the file line by line and parses lines on workers; the driver then joins
labels and ids and writes the tables with ``write_kg``. The join holds every entity in the
driver's memory (as the MediaWiki loader's resolve pass does): fine for extracts and
domain graphs of millions of claims; the full dump (~100 M items) needs a topic extract.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osvl.errors import DataError
from osvl.kg.anchors import read_licences
from osvl.kg.schema import write_kg

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


def _rows(path: Path) -> list[list[str]]:
    """A small delimited table (the label table); tab for .tsv, else comma."""
    text = path.read_text(encoding="utf-8")
    return [r for r in csv.reader(io.StringIO(text), delimiter="\t" if path.suffix == ".tsv" else ",") if r]


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


def _parse_batch(batch: dict[str, Any], fmt: str, language: str, delimiter: str) -> dict[str, list[str]]:
    """Ray Data ``map_batches``: lines -> JSON-encoded records ("" for a line that does not parse, with why)."""
    out: dict[str, list[str]] = {"record": [], "error": []}
    for line in batch["text"]:
        try:
            rec = parse_entity(line, language) if fmt == "wikidata_json" else parse_triple(line, delimiter)
        except DataError as e:
            out["record"].append("")
            out["error"].append(str(e)[:200])
            continue
        if rec is not None:
            out["record"].append(json.dumps(rec))
            out["error"].append("")
    return out


def _records_from_triples(triples: list[tuple[str, str, str]], labels_path: Path | None) -> list[dict[str, Any]]:
    """Group triples by subject into the records ``parse_entity`` makes, labels from the label table."""
    labels: dict[str, tuple[str, str]] = {}
    aliases: dict[str, list[str]] = {}
    if labels_path is not None:
        for row in _rows(labels_path):
            cells = [_bare(c) for c in row] + ["", "", ""]
            if cells[0].lower() != "id":
                labels[cells[0]] = (cells[1], cells[2])
                aliases[cells[0]] = [a.strip() for a in cells[3].split("|") if a.strip()]
    subjects = {s for s, _, _ in triples}
    claims: dict[str, list[dict[str, str]]] = defaultdict(list)
    for s, p, o in triples:
        is_item = o in subjects or (_ITEM_ID.match(o) is not None and o in labels)
        kind = "image" if p in (IMAGE_PROPERTY, "image") else "item" if is_item else "literal"
        claims[s].append({"property": p, "kind": kind, "value": o, "unit": ""})
    ids = subjects | {c["value"] for cs in claims.values() for c in cs if c["kind"] == "item"}
    records = [{"id": i, "type": "item", "label": labels.get(i, ("", ""))[0], "description": labels.get(i, ("", ""))[1],
                "aliases": aliases.get(i, []), "datatype": "", "claims": claims.get(i, [])} for i in sorted(ids)]
    records += [{"id": p, "type": "property", "label": lab, "description": "", "aliases": [], "datatype": "",
                 "claims": []} for p, (lab, _) in labels.items() if _PROPERTY_ID.match(p)]
    return records


def assemble(records: list[dict[str, Any]], images_dir: Path | None = None,
             kg_dir: Path | None = None) -> tuple[list[dict[str, Any]], list[tuple[int, int, str]],
                                                  list[dict[str, Any]], Counter[str]]:
    """Records -> (entities, links, anchors, counts), ids and property labels resolved."""
    counts: Counter[str] = Counter()
    prop_label = dict(PROPERTY_LABELS)
    prop_label.update({r["id"]: r["label"] for r in records if r["type"] == "property" and r["label"]})
    # Ray Data hands records back in no fixed order; ids must not depend on it
    items = sorted((r for r in records if r["type"] == "item"), key=lambda r: (len(r["id"]), r["id"]))
    index = {r["id"]: i for i, r in enumerate(items)}
    item_label = {r["id"]: r["label"] for r in items if r["label"]}

    def relation(p: str) -> str:
        return prop_label.get(p, "" if _PROPERTY_ID.match(p) else p)  # a triples file may name properties by label

    licences = read_licences(images_dir) if images_dir else {}
    entities, links, anchors = [], [], []
    for i, r in enumerate(items):
        counts["unlabelled_entity"] += not r["label"]
        ent = {"id": i, "title": r["label"] or r["id"], "aliases": [a for a in r["aliases"] if a],
               "description": r["description"], "text": r["description"], "attributes": [], "images": [],
               "categories": [], "kind": "article", "origin": "wikidata"}
        desc = r["description"].lower()
        if "disambiguation page" in desc:
            ent["kind"] = "disambiguation"
        elif "list article" in desc:
            ent["kind"] = "list"
        for c in r["claims"]:
            rel = relation(c["property"])
            if c["kind"] == "skip":
                counts["claim_not_a_fact"] += 1
            elif c["kind"] == "image":
                ent["images"].append(c["value"])
            elif not rel:
                counts["claim_unlabelled_property"] += 1
            elif c["kind"] == "item":
                if c["value"] not in index:
                    counts["link_to_missing_item"] += 1
                    continue
                links.append((i, index[c["value"]], rel))
                if c["property"] in (INSTANCE_OF, "instance of") and c["value"] in item_label:
                    ent["categories"].append(item_label[c["value"]])
                elif c["value"] in item_label:  # shown on the page ("country: France."), asked as an entity answer
                    ent["attributes"].append({"key": rel, "value": item_label[c["value"]], "eligible": False,
                                              "source": f"{c['property']}: {c['value']}"})
            else:
                unit = UNITS.get(c["unit"]) or item_label.get(c["unit"], "")
                value = f"{c['value']} {unit}".strip()
                ent["attributes"].append({"key": rel, "value": value, "source": f"{c['property']}: {value}"})
        entities.append(ent)
        for name in ent["images"] if images_dir else []:
            src = next((images_dir / n for n in (name, name.replace(" ", "_")) if (images_dir / n).is_file()), None)
            if src is None or kg_dir is None:
                continue
            (kg_dir / "images").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, kg_dir / "images" / src.name)
            anchors.append({"entity_id": i, "image": src.name, "caption": f"{ent['title']}: {ent['description']}",
                            "source": f"wikidata {IMAGE_PROPERTY}", "licence": licences.get(src.name, ""),
                            "score": 1.0, "scorer": "wikidata_p18"})
    counts["links"], counts["anchors"] = len(links), len(anchors)
    return entities, links, anchors, counts


def build(path: Path, fmt: str, kg_dir: Path, *, labels: Path | None = None, images_dir: Path | None = None,
          language: str = "en", workers: int = 2, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Parse ``path`` on Ray Data, join on the driver, write the KG tables into ``kg_dir``; returns counts."""
    import ray

    if fmt not in FORMATS:
        raise DataError(f"unknown Wikidata format {fmt!r}; one of {FORMATS}")
    ray.data.DataContext.get_current().enable_progress_bars = False
    delimiter = "\t" if ".tsv" in path.suffixes else ","
    ds = ray.data.read_text(str(path), override_num_blocks=max(1, workers))
    ds = ds.map_batches(_parse_batch, fn_kwargs={"fmt": fmt, "language": language, "delimiter": delimiter},
                        batch_format="numpy", num_cpus=1)
    parsed, bad = [], []
    for row in ds.iter_rows():
        if row["record"]:
            parsed.append(json.loads(row["record"]))
        else:
            bad.append(row["error"])
    log(f"build_kg: {len(parsed)} {'entities' if fmt == 'wikidata_json' else 'triples'} parsed, "
        f"{len(bad)} bad lines skipped")
    records = parsed if fmt == "wikidata_json" else _records_from_triples(sorted(tuple(t) for t in parsed), labels)
    if images_dir is not None and kg_dir.joinpath("images").is_dir():
        shutil.rmtree(kg_dir / "images")  # a rebuild must not keep photos of a former input
    entities, links, anchors, counts = assemble(records, images_dir, kg_dir)
    written = write_kg(kg_dir, entities, links, anchors)
    return {**written, "bad_lines": len(bad), "bad_examples": bad[:5], **dict(counts)}
