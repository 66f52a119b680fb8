"""MediaWiki ``pages-articles`` XML exports -> KG rows, streamed from .bz2.

This is the format of the full English dump (~100 GB of XML), so nothing here holds more
than one page at a time: ``iter_pages`` streams with ``iterparse`` and clears each
``<page>`` element (and the root's reference to it) once read, and ``parse_page`` is a
pure function of one page that a Ray Data ``map`` can call on a shard. Only ``load`` (for
small exports such as the shared sample) keeps everything, to resolve links through
redirects; on the full dump that resolution is a join done by the pipeline.

What a page gives:
- namespace-0 redirects become aliases of their target;
- ``[[Target|label]]`` links become edges, resolved through redirects; the relation is the
  infobox field whose value contains the link, else ``linked_to``;
- ``{{Infobox ...}}`` fields become attributes (value with markup stripped, source = the
  raw ``| key = value`` field);
- ``[[File:...]]``/``[[Image:...]]`` and infobox ``image =`` become image names;
- ``[[Category:...]]`` become categories.

Wikitext is parsed with regexes and brace counting, not a full parser: infoboxes, links
and files are regular enough for that, and exotic templates simply drop out of values.
"""

from __future__ import annotations

import bz2
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from osvl.errors import DataError
from osvl.kg.schema import DEFAULT_RELATION, fold, write_kg

NAMESPACES = ("file", "image", "category", "template", "wikipedia", "help", "portal", "user", "talk",
              "media", "special", "module", "draft", "book", "wp", "wikt", "wiktionary", "s", "commons")
MAX_TEXT_CHARS = 1500


@dataclass
class Page:
    title: str
    ns: int
    id: int
    redirect: str  # target title, "" when not a redirect
    text: str  # raw wikitext of the latest revision


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def iter_page_fields(source: str | Path | IO[bytes]) -> Iterator[dict[str, str]]:
    """Stream the pages of an export as raw string fields ``title, ns, id, redirect, text``.

    Nothing is validated here, so that one malformed page (``<ns>zero</ns>``) does not end
    the stream: the Ray Data job ships these plain dicts to workers, which call
    ``page_from_fields`` and count the pages it rejects. Malformed *XML* still raises
    ``DataError``: past a syntax error there is no next page to read.
    """
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"MediaWiki export {path} does not exist")
        f: IO[bytes] = bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")
    else:
        f = source
    try:
        context = ET.iterparse(f, events=("start", "end"))
        root = None
        for event, elem in context:
            if root is None and event == "start":
                root = elem
            if event != "end" or _local(elem.tag) != "page":
                continue
            fields = {"title": "", "ns": "0", "id": "0", "redirect": "", "text": ""}
            for child in elem:
                name = _local(child.tag)
                if name in ("title", "ns", "id"):
                    fields[name] = child.text or ""
                elif name == "redirect":
                    fields["redirect"] = child.get("title", "")
                elif name == "revision":
                    for sub in child:
                        if _local(sub.tag) == "text":
                            fields["text"] = sub.text or ""
            yield fields
            elem.clear()
            if root is not None:
                root.clear()  # drops the root's references to finished pages: memory stays flat
    except ET.ParseError as e:
        raise DataError(f"malformed MediaWiki XML: {e}") from e
    finally:
        if isinstance(source, str | Path):
            f.close()


def page_from_fields(fields: dict[str, str]) -> Page:
    """A ``Page`` from ``iter_page_fields`` output; ``DataError`` when ns/id are not integers or the title is empty."""
    try:
        ns, page_id = int(fields["ns"]), int(fields["id"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"page {fields.get('title')!r}: ns/id are not integers ({e})") from e
    if not (fields.get("title") or "").strip():
        raise DataError(f"page id {page_id}: empty title")
    return Page(fields["title"], ns, page_id, fields.get("redirect") or "", fields.get("text") or "")


def iter_pages(source: str | Path | IO[bytes]) -> Iterator[Page]:
    """Stream the pages of an export (.xml or .xml.bz2 path, or a binary file object)."""
    for fields in iter_page_fields(source):
        yield page_from_fields(fields)


_BRACES = re.compile(r"\{\{|\}\}")


def _balanced(text: str, start: int) -> int:
    """Index just past the ``}}`` closing the ``{{`` at ``start`` (len(text) if unclosed)."""
    depth = 0
    for m in _BRACES.finditer(text, start):
        depth += 1 if m.group() == "{{" else -1
        if depth == 0:
            return m.end()
    return len(text)


def _split_fields(body: str) -> list[str]:
    """Split a template body at top-level ``|`` (not inside [[...]] or {{...}})."""
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(body):
        two = body[i : i + 2]
        if two in ("{{", "[["):
            depth += 1
            cur.append(two)
            i += 2
            continue
        if two in ("}}", "]]"):
            depth -= 1
            cur.append(two)
            i += 2
            continue
        if body[i] == "|" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(body[i])
        i += 1
    parts.append("".join(cur))
    return parts


def strip_markup(s: str) -> str:
    """Wikitext to plain text: links to labels, templates/refs/comments/tags/tables dropped."""
    s = re.sub(r"<!--.*?-->", "", s, flags=re.S)
    s = re.sub(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", "", s, flags=re.S)
    out, i = [], 0
    while True:  # drop templates with brace counting (regex cannot nest)
        j = s.find("{{", i)
        if j < 0:
            out.append(s[i:])
            break
        out.append(s[i:j])
        i = _balanced(s, j)
    s = "".join(out)
    s = re.sub(r"\{\|.*?\|\}", "", s, flags=re.S)
    s = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", s, flags=re.I)
    s = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", s)
    s = re.sub(r"\[https?://\S+\s*([^\]]*)\]", r"\1", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = s.replace("'''", "").replace("''", "").replace("&nbsp;", " ")
    return re.sub(r"[ \t]+", " ", s).strip()


def _target(link: str) -> str | None:
    t = link.split("|", 1)[0].split("#", 1)[0].strip().replace("_", " ")
    if not t or (":" in t and t.split(":", 1)[0].strip().lower() in NAMESPACES):
        return None
    return t[0].upper() + t[1:]  # first-letter case-insensitive, as <case>first-letter</case> says


def parse_page(page: Page) -> dict[str, Any]:
    """One page -> a row: ``title, redirect, ns, text, attributes, links, images, categories, kind``.

    ``links`` are ``(target title, relation)`` pairs, unresolved (redirects resolve later).
    Pure and picklable, so that a Ray Data ``map`` can call it on each page of a shard.
    """
    wt = page.text or ""
    row: dict[str, Any] = {"title": page.title, "redirect": page.redirect, "ns": page.ns, "text": "",
                           "attributes": [], "links": [], "images": [], "categories": [], "kind": "article"}
    if page.redirect or page.ns != 0:
        return row
    link_rel: dict[str, str] = {}
    seen: set[str] = set()
    m = re.search(r"\{\{\s*Infobox", wt, flags=re.I)
    if m:
        end = _balanced(wt, m.start())
        for field in _split_fields(wt[m.start() + 2 : end - 2])[1:]:
            if "=" not in field:
                continue
            key, raw = (x.strip() for x in field.split("=", 1))
            for link in re.findall(r"\[\[([^\]]+)\]\]", raw):
                t = _target(link)
                if t:
                    link_rel.setdefault(t, key)
            if key.lower() in ("image", "image_name", "photo", "logo") and raw:
                row["images"].append(re.sub(r"^(File|Image):", "", raw.split("|")[0].strip(), flags=re.I))
                continue
            value = strip_markup(raw)
            if value and len(value) <= 200 and key:
                row["attributes"].append({"key": key.replace("_", " "), "value": re.sub(r"\s+", " ", value),
                                          "source": f"| {key} = {raw}"[:300]})
    for link in re.findall(r"\[\[([^\[\]]+)\]\]", wt):
        head = link.split(":", 1)[0].strip().lower() if ":" in link else ""
        if head in ("file", "image"):
            row["images"].append(link.split(":", 1)[1].split("|")[0].strip())
        elif head == "category":
            row["categories"].append(link.split(":", 1)[1].split("|")[0].strip())
        elif (t := _target(link)) and t not in seen:
            seen.add(t)
            row["links"].append((t, link_rel.get(t, DEFAULT_RELATION)))
    if re.search(r"\{\{\s*(disambiguation|dab|disambig|hndis|geodis)\b", wt, flags=re.I):
        row["kind"] = "disambiguation"
    elif page.title.startswith("List of"):
        row["kind"] = "list"
    plain = strip_markup(wt)
    paras = [p.strip() for p in plain.split("\n\n") if p.strip() and not p.strip().startswith(("=", "*", "|", "!"))]
    row["text"] = "\n\n".join(paras)[:MAX_TEXT_CHARS]
    return row


def load(source: str | Path | IO[bytes]) -> tuple[list[dict[str, Any]], list[tuple[int, int, str]]]:
    """Entity rows and links of a small export: redirects -> aliases, links resolved through them."""
    rows: list[dict[str, Any]] = []
    redirects: dict[str, str] = {}  # folded redirect title -> target title
    redirect_titles: list[str] = []
    for page in iter_pages(source):
        if page.ns != 0:
            continue
        if page.redirect:
            redirects[fold(page.title)] = page.redirect
            redirect_titles.append(page.title)
            continue
        rows.append(parse_page(page))
    ids = {fold(r["title"]): i for i, r in enumerate(rows)}
    entities = []
    for i, r in enumerate(rows):
        entities.append({"id": i, "title": r["title"], "aliases": [], "description": "", "text": r["text"],
                         "attributes": r["attributes"], "images": r["images"], "categories": r["categories"],
                         "kind": r["kind"], "origin": "mediawiki"})
    for alias in redirect_titles:
        target = fold(redirects[fold(alias)])
        if target in ids:
            entities[ids[target]]["aliases"].append(alias)
    links = []
    for i, r in enumerate(rows):
        for t, rel in r["links"]:
            k = fold(t)
            k = fold(redirects.get(k, t)) if k not in ids else k  # one redirect hop, as MediaWiki itself does
            if k in ids and ids[k] != i:
                links.append((i, ids[k], rel))
    return entities, links



def main(argv: list[str] | None = None) -> None:
    """``python -m osvl.kg.mediawiki EXPORT.xml[.bz2] OUT_DIR``: a KG folder from one export.

    Fine for exports that fit in memory (the shared sample, a topic export from
    Special:Export); the full dump goes through the Ray Data synthesis job, which maps
    ``parse_page`` over shards and joins links with the redirect table.
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m osvl.kg.mediawiki EXPORT.xml[.bz2] OUT_DIR")
    entities, links = load(args[0])
    print(json.dumps(write_kg(args[1], entities, links)))


if __name__ == "__main__":
    main()
