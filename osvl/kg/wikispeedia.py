"""Wikispeedia (Wikipedia for Schools 2007) plus Wikidata summaries -> KG entity rows and links.

Wikispeedia ships the link graph (``links.tsv``), categories, and the plain text of each
article; the plain text keeps the infobox as loose lines at the top of the article:
``Kingdom: Animalia``, gap-separated ``Born      March 14, 1879``, and colon-less
``Official languages Amharic`` (the rendered infobox lost its table cells). We parse those
three forms into attributes, each keeping its source line.

Colon-less lines are the hard case: nothing marks where the key ends. We learn a key
vocabulary from the corpus itself (line prefixes that start the infobox lines of many
articles, plus every explicit ``Key:`` key) and split a line at its longest known key.
A key alone on its line takes the next line as its value (``Capital`` /
``(and largest city) Addis Ababa``, ``Binomial name`` / ``Panthera leo``).

The Wikidata summaries (``summaries_en.json``) give short descriptions for the ~2,000
overlapping titles and ~8,000 extra entities (Eiffel Tower, Koala, ...) that the schools
selection lacks; those become entities whose out-links are the titles their extract
mentions, so that photographed landmarks and animals join the graph.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from osvl.errors import DataError
from osvl.kg.schema import DEFAULT_RELATION, fold

MAX_TEXT_CHARS = 1500
"""Article text kept per entity: the lead and what follows, cut at a sentence end.
Enough for BM25 search and rewriting; the full text would blow the sample's size budget."""

MIN_KEY_ARTICLES = 5
"""A colon-less line prefix is a key when this many articles start an infobox line with it."""

_SKIP_LINE = re.compile(
    r"^(Flag|Coat of arms|Location of|CAPTION|Enlarge|Map of|Seal of|Image:|This is a featured|This)\b|\d+°"
)
_STOP_END = {"of", "the", "and", "in", "a", "an", "to", "for", "on", "at", "by", "with", "or", "de"}
_FOOTNOTE = re.compile(r"\^\s?[\d\w]{1,2}\b|\[\d+\]")


def title_from_url(name: str) -> str:
    return unquote(name).replace("_", " ")


def _paragraphs(lines: list[str]) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


def _is_prose(block: list[str]) -> bool:
    """A paragraph of running text, as opposed to infobox cells, captions or headings."""
    stripped = [line.strip() for line in block]
    joined = " ".join(stripped)
    if len(joined) < 120 or joined.startswith("^") or any("Enlarge" == s for s in stripped):
        return False
    if any(re.search(r"\S {3,}\S", s) for s in stripped):  # column gaps mean an infobox table
        return False
    return sum(len(s) for s in stripped) / len(stripped) >= 45 and ". " in joined + " "


def split_article(raw: str) -> tuple[list[str], str]:
    """(infobox lines, prose text) of one Wikispeedia plain-text article.

    The header (``#copyright``, title, "2007 Schools Wikipedia Selection" paragraph and the
    "SOS Children" notes) is dropped; infobox lines are everything before the first prose
    paragraph; prose keeps only prose paragraphs (headings and image captions go).
    """
    blocks = _paragraphs(raw.splitlines())
    body_start = 0
    for i, b in enumerate(blocks):
        if "Schools Wikipedia Selection" in b[0]:
            body_start = i + 1
            break
    blocks = [b for b in blocks[body_start:] if not re.match(r"\s*(SOS Children|Note: This article)", b[0])]
    first = next((i for i, b in enumerate(blocks) if _is_prose(b)), len(blocks))
    infobox = [line for b in blocks[:first] for line in b + [""]]
    prose = [" ".join(s.strip() for s in b) for b in blocks[first:] if _is_prose(b)]
    return infobox, "\n\n".join(prose)


def trim(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """At most ``limit`` characters, cut after the last full sentence when there is one."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = max(cut.rfind(". "), cut.rfind(".\n"))
    return cut[: end + 1] if end > limit // 3 else cut


def _clean_value(v: str) -> str:
    v = _FOOTNOTE.sub("", v)
    v = re.sub(r"\(\s+", "(", v)
    return re.sub(r"\s+", " ", v).strip(" ;,")


def _explicit_pair(line: str) -> tuple[str, str] | None:
    """``Key: value`` or ``Key   value`` (a column gap), key of 1-5 words starting with a letter."""
    s = line.strip()
    m = re.match(r"^([A-Za-z][^:]{0,40}?):\s*(\S.*)$", s) or re.match(r"^([A-Z][^\s].{0,40}?)\s{2,}(\S.*)$", s)
    if not m or len(m.group(1).split()) > 5 or "http" in s:
        return None
    return m.group(1).strip(), m.group(2)


def learn_keys(infoboxes: list[list[str]]) -> set[str]:
    """Infobox keys of the corpus: explicit keys, and line prefixes frequent across articles.

    A prefix counts as a key only when what follows it varies across articles: "Official
    languages" is followed by many languages, "Official" almost always by "languages", and
    "Time zone EAT" always by "(" (a value shared by East African countries, not a key).
    """
    explicit: Counter[str] = Counter()
    alone: Counter[str] = Counter()
    prefixes: Counter[str] = Counter()
    following: dict[str, set[str]] = {}
    for lines in infoboxes:
        seen_e: set[str] = set()
        seen_p: set[str] = set()
        for line in lines:
            s = line.strip().lstrip("- ").strip()
            if not s or _SKIP_LINE.search(s):
                continue
            pair = _explicit_pair(s)
            if pair:
                seen_e.add(pair[0])
            words = s.split()
            if len(words) <= 3 and words[0][0].isupper() and not re.search(r"\d", s):
                alone[s] += 1
            for n in range(1, min(4, len(words) - 1) + 1):
                p = " ".join(words[:n])
                if words[0][0].isupper() and not re.search(r"\d", p) and words[n - 1].lower() not in _STOP_END:
                    seen_p.add(p)
                    following.setdefault(p, set()).add(words[n].lower())
        explicit.update(seen_e)
        prefixes.update(seen_p)
    keys = {k for k, n in explicit.items() if n >= 2}
    keys |= {k for k, n in alone.items() if n >= MIN_KEY_ARTICLES}  # "Binomial name" heading its value
    keys |= {
        p
        for p, n in prefixes.items()
        if n >= MIN_KEY_ARTICLES and len(following[p]) >= max(3, 0.3 * n)
    }
    return keys


def parse_infobox(lines: list[str], keys: set[str], title: str) -> list[dict[str, str]]:
    """Attributes ``{key, value, source}`` from an article's infobox lines."""
    attrs: list[dict[str, str]] = []
    parent = ""
    last_key = ""
    i = 0
    while i < len(lines):
        raw = lines[i]
        s = raw.strip()
        i += 1
        if not s or s == title or _SKIP_LINE.search(s):
            last_key = ""
            continue
        sub = s.startswith("- ")
        body = s[2:].strip() if sub else s
        indent = len(raw) - len(raw.lstrip())
        if last_key and indent >= 10 and not re.search(r"\s{2,}", s) and not s.startswith("^"):
            # deep-indented line under a gap-format key: another value of it (Einstein's Institution)
            if len(s.split()) <= 8:
                attrs.append({"key": last_key, "value": _clean_value(s), "source": s})
            continue
        last_key = ""
        pair = _explicit_pair(body)
        if pair is None and body not in keys:
            # colon-less: split at the shortest known key (longer prefixes tend to swallow values)
            words = body.split()
            for n in range(1, min(4, len(words) - 1) + 1):
                if " ".join(words[:n]) in keys:
                    pair = (" ".join(words[:n]), " ".join(words[n:]))
                    break
        if pair is None and body in keys:
            # a key alone on its line: its value is the next non-empty line
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and lines[j].strip().startswith("-"):
                parent = body  # "Area" heading its " - Total ..." sub-lines
                continue
            if j < len(lines) and _explicit_pair(lines[j]) is None:
                nxt = lines[j].strip()
                m = re.match(r"^(\([^)]*\))\s*(\S.*)$", nxt)
                key = f"{body} {m.group(1)}" if m else body
                pair = (key, m.group(2) if m else nxt)
                s = f"{s} / {nxt}"
                i = j + 1
        if pair is None:
            continue
        key, value = pair
        if sub and parent:
            key = f"{parent} - {key}"
        elif not sub:
            parent = key
        value = _clean_value(value)
        if value and len(value) <= 200:
            attrs.append({"key": key, "value": value, "source": s})
        last_key = key if re.search(r"\S\s{2,}\S", s) else ""
    return attrs


def _kind(title: str, description: str, text: str) -> str:
    d = description.lower()
    if "disambiguation" in d or re.search(r"\bmay (also )?refer to\b", text[:300]):
        return "disambiguation"
    if title.startswith("List of") or "list article" in d or "wikimedia list" in d:
        return "list"
    if re.match(r"^(\d+(st|nd|rd|th) century|\d{3,4}s?|Timeline of|Index of|Outline of|Glossary of)\b", title):
        return "index"
    return "article"


_ALIAS_PATTERNS = [
    re.compile(r"\b(?:also|sometimes|commonly|formerly|popularly|better|locally) (?:inaccurately )?"
               r"(?:known|called|spelled|named|referred to)(?: as)? (?:the |a )?[\"“]?(\w[^,;.()\"”]{1,50})"),
    re.compile(r"\bor simply (?:the |a )?(\w[\w -]{1,40})"),
    re.compile(r"\b(?:or|officially) (?:the )?[\"“]?([A-Z][^,;.()\"”]{1,50})"),
]


def lead_aliases(title: str, text: str) -> list[str]:
    """Alternative names in the first sentence: "X, also known as Y", "The X or Y is ..."."""
    first = re.split(r"(?<=[\w)])\. ", text[:400], maxsplit=1)[0]
    out: list[str] = []
    for pat in _ALIAS_PATTERNS:
        for m in pat.finditer(first):
            if pat is _ALIAS_PATTERNS[2] and m.start() > len(title) + 30:
                continue  # "or" far from the subject is not naming it
            name = re.split(r"\s+(?:is|was|are|were|and|in|from|which|that|or)\b", m.group(1))[0].strip(" '\"")
            if 2 <= len(name) <= 50 and fold(name) != fold(title) and name not in out:
                out.append(name)
    return out


def read_tsv(path: Path) -> Iterator[list[str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                yield line.rstrip("\n").split("\t")


def read_articles(folder: Path) -> dict[str, str]:
    """title -> raw plain text, straight from the .tgz (no extraction to disk)."""
    texts: dict[str, str] = {}
    with tarfile.open(folder / "plaintext_articles.tgz") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".txt"):
                name = member.name.rsplit("/", 1)[-1][: -len(".txt")]
                texts[title_from_url(name)] = tar.extractfile(member).read().decode("utf-8", "replace")
    return texts


_fold = lru_cache(maxsize=1 << 18)(fold)  # extracts repeat the same n-grams; folding dominates the scan


def mention_links(
    text: str, index: dict[str, int], self_id: int, max_words: int = 5, any_case: bool = False
) -> list[int]:
    """Ids whose title is mentioned in ``text`` (longest match first, capitalised start).

    Requiring a capital letter keeps common-noun titles ("Water", "Gold") from linking every
    extract that uses the word in passing, while proper names still match; ``any_case``
    drops that rule (grounding wants every subject a caption might be about, "music" too).
    """
    words = re.findall(r"[\w'’-]+", text)
    out: list[int] = []
    i = 0
    while i < len(words):
        hit = 0
        if any_case or words[i][:1].isupper():
            for n in range(min(max_words, len(words) - i), 0, -1):
                eid = index.get(_fold(" ".join(words[i : i + n])))
                if eid is not None and eid != self_id:
                    if eid not in out:
                        out.append(eid)
                    hit = n
                    break
        i += max(hit, 1)
    return out


def attribute_relations(
    entities: dict[int, dict[str, Any]], links: list[tuple[int, int]]
) -> list[tuple[int, int, str]]:
    """Label each link with the attribute key whose value names its target, else ``linked_to``."""
    out = []
    for s, d in links:
        target = f" {fold(entities[d]['title'])} "
        rel = DEFAULT_RELATION
        for a in entities[s]["attributes"]:
            if target in f" {fold(a['value'])} ":
                rel = a["key"]
                break
        out.append((s, d, rel))
    return out


def load(
    wikispeedia: str | Path, summaries: str | Path | None = None, text_chars: int = MAX_TEXT_CHARS
) -> tuple[list[dict], list[tuple]]:
    """Entity rows and (src, dst, relation) links from Wikispeedia joined with the summaries.

    Wikispeedia articles get ids 0..N-1 in ``articles.tsv`` order; summary-only entities
    follow in title order, so ids are stable for a given pair of inputs.
    """
    folder = Path(wikispeedia)
    if not (folder / "articles.tsv").is_file():
        raise DataError(f"{folder} is not a Wikispeedia folder (no articles.tsv)")
    titles = [title_from_url(r[0]) for r in read_tsv(folder / "articles.tsv")]
    ids = {t: i for i, t in enumerate(titles)}
    cats: dict[str, list[str]] = {}
    for r in read_tsv(folder / "categories.tsv"):
        cats.setdefault(title_from_url(r[0]), []).append(r[1])
    raw = read_articles(folder)
    split = {t: split_article(raw.get(t, "")) for t in titles}
    keys = learn_keys([box for box, _ in split.values()])
    summ: dict[str, dict] = {}
    if summaries is not None:
        with open(summaries, encoding="utf-8") as f:
            summ = json.load(f)

    entities: dict[int, dict[str, Any]] = {}
    for t in titles:
        box, prose = split[t]
        s = summ.get(t, {})
        text = trim(prose, text_chars)
        entities[ids[t]] = {
            "id": ids[t],
            "title": t,
            "aliases": lead_aliases(t, prose),
            "description": s.get("description", ""),
            "text": text,
            "attributes": parse_infobox(box, keys, t),
            "images": [],
            "categories": cats.get(t, []),
            "kind": _kind(t, s.get("description", ""), prose),
            "origin": "wikispeedia",
        }
    pairs: list[tuple[int, int]] = []
    for r in read_tsv(folder / "links.tsv"):
        s_t, d_t = title_from_url(r[0]), title_from_url(r[1])
        if s_t in ids and d_t in ids:
            pairs.append((ids[s_t], ids[d_t]))

    folded_titles = {fold(x) for x in titles}
    extra = sorted(t for t in summ if fold(t) not in folded_titles)
    for t in extra:
        s = summ[t]
        eid = len(entities)
        entities[eid] = {
            "id": eid,
            "title": t,
            "aliases": lead_aliases(t, s.get("extract", "")),
            "description": s.get("description", ""),
            "text": trim(s.get("extract", ""), text_chars),
            "attributes": [],
            "images": [],
            "categories": [f"topic.{s['topic']}"] if s.get("topic") else [],
            "kind": _kind(t, s.get("description", ""), s.get("extract", "")),
            "origin": "wikidata",
        }
    index = {fold(e["title"]): i for i, e in entities.items()}
    for t in extra:
        eid = index[fold(t)]
        pairs += [(eid, d) for d in mention_links(summ[t].get("extract", ""), index, eid)]
    return list(entities.values()), attribute_relations(entities, pairs)
