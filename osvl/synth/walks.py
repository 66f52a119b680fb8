"""The KG as synthesis sees it, and constrained random walks over it.

``Graph`` is a read-only view of the KG (the tables ``osvl.kg.schema`` defines) holding only
what synthesis needs: names, short descriptions, categories, answerable attributes,
deduplicated adjacency and value frequencies. It reads them from the graph compiled once per
node (``osvl.kg.compiled``), which every worker of the node maps rather than copies, so a
node's memory follows the KG, not its worker count. It can also be built from plain lists of
row dicts, which is how unit tests make graphs of a dozen entities.

A walk starts at a *seed* (an entity with a grounded anchor image), takes ``h``
hops along out-links and ends at an entity with an answerable attribute, or (an *entity
answer*, ``walk.entity_answers``) at the entity its last relation points to: "the country of
...", answered with that entity's name and aliases. The constraints and why:

- hubs (in-degree above a threshold) are skipped: "the country linked from the
  article on X" is never a unique referent when X links to 200 countries, and
  hub paths make every question look alike;
- list, index and disambiguation pages are skipped: they are not things;
- no entity twice (no cycles): a question that returns to its start is trivial;
- every entity of the walk belongs to the seed's split (``assign_splits``; an asked entity, a value
  like an attribute's, may be in any), which
  is how "no path entity in two splits" holds by construction while shards run
  independently (a seed's sparse neighbourhood, up to the walk depth, joins its split);
- the last hop only goes to entities with an eligible answer attribute, and the
  attribute is drawn with weight 1 / (how many entities share that value), so
  that frequent values ("Animalia", "English") do not swamp the answers;
- an entity answer needs a relation that is a fact (not ``linked_to`` nor a type), with one target from
  the entity before it (``askable_relation``: "the occupation of" a person with three has no answer), and
  at least one hop before it, so the answer is read off a page the question describes.
"""

from __future__ import annotations

import hashlib
import itertools
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

from osvl.kg.compiled import CompiledGraph, compile_graph, ensure
from osvl.kg.schema import SAMPLE_DIR
from osvl.synth.invariants import fold

Split = Literal["sft", "rl", "heldout", "dev"]
"""``dev`` is the development split: where settings are tuned on figures, so that ``heldout`` is used only for
the figures reported (empty unless a config gives it a share; a 3-share config is sft/rl/heldout as before)."""
SPLITS = get_args(Split)

# Infobox lines that are not facts about the thing (image captions, navigation, markup remnants).
NON_ANSWER_KEYS = {"caption", "image", "coordinates", "website", "see also", "spoiler warning", "source",
                   "map", "footnotes", "notes", "signature", "logo", "url", "image caption"}
LIST_PREFIXES = ("list of ", "lists of ", "index of ", "outline of ", "timeline of ", "glossary of ")
# Relations that give a thing's type, not a fact about it: "the instance of ..." is no question (a type is asked
# "what kind of thing is ...", which the grammar does not make)
TYPE_RELATIONS = {"instance of", "subclass of", "linked to"}  # folded: "linked_to" folds to "linked to"
LIST_DESCRIPTIONS = ("wikimedia list article", "wikimedia disambiguation page", "wikimedia index",
                     "wikimedia set index article")


@dataclass
class Entity:
    id: int
    title: str
    aliases: list[str]
    description: str
    categories: list[str]
    attributes: list[tuple[str, str]]
    answers: list[tuple[str, str]]  # eligible (key, value) pairs whose key has one value
    list_page: bool
    in_degree: int
    folded_attributes: set[tuple[str, str]] = field(default_factory=set)

    def attribute_values(self, key: str) -> list[str]:
        k = fold(key)
        return sorted(v for fk, v in self.folded_attributes if fk == k)


@dataclass
class Anchor:
    image: str
    caption: str
    source: str
    licence: str
    score: float
    scorer: str


def _is_list_page(row: dict[str, Any]) -> bool:
    kind = fold(str(row.get("kind") or ""))
    if kind and kind not in ("article", "entity", "page"):
        return True
    title = fold(row["title"]) + " "
    desc = fold(row.get("description") or "")
    return title.startswith(LIST_PREFIXES) or "disambiguation" in title or desc in LIST_DESCRIPTIONS


def _answers(attributes: list[dict[str, Any]], max_words: int) -> list[tuple[str, str]]:
    """Eligible answers: the KG's ``eligible`` flag when it has one, else short non-navigation values."""
    per_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in attributes:
        per_key[fold(a["key"])].append(a)
    out = []
    for key, rows in per_key.items():
        if len(rows) != 1 or not key or key in NON_ANSWER_KEYS:
            continue  # a key with two values has no single answer
        a = rows[0]
        if "eligible" in a and a["eligible"] is not None and not a["eligible"]:
            continue
        value = " ".join(str(a["value"]).split())
        if value and len(value.split()) <= max_words and fold(value):
            out.append((a["key"].strip(), value))
    return out


def _entity(row: dict[str, Any], max_words: int) -> Entity:
    """One entity row as synthesis sees it; raises on a malformed row (the compiler skips and counts it)."""
    attrs = [dict(a) for a in (row.get("attributes") or [])]
    return Entity(id=int(row["id"]), title=str(row["title"]), aliases=[str(a) for a in (row.get("aliases") or [])],
                  description=str(row.get("description") or ""),
                  categories=[str(c) for c in (row.get("categories") or [])],
                  attributes=[(str(a["key"]), str(a["value"])) for a in attrs],
                  answers=_answers(attrs, max_words), list_page=_is_list_page(row),
                  in_degree=int(row.get("in_degree") or 0))


def _entity_at(kg: CompiledGraph, row: int) -> Entity:
    rec = kg.record(row)
    pairs = {k: [(p["key"], p["value"]) for p in rec[k]] for k in ("attributes", "answers")}
    return Entity(id=rec["id"], title=rec["title"], aliases=rec["aliases"], description=rec["description"],
                  categories=rec["categories"], attributes=pairs["attributes"], answers=pairs["answers"],
                  list_page=rec["list_page"], in_degree=rec["in_degree"],
                  folded_attributes={(fold(k), fold(v)) for k, v in pairs["attributes"]})


def _one_edge_per_neighbour(pairs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """One edge per neighbour for walking; a typed relation beats ``linked_to`` because it words better."""
    best: dict[int, str] = {}
    for dst, rel in sorted(pairs):
        if dst not in best or (best[dst] == "linked_to" and rel != "linked_to"):
            best[dst] = rel
    return sorted(best.items())


class _ByRow(Mapping[int, Any]):
    """Entity id -> ``value(row)``, cached for the entities a worker keeps visiting (a walk's neighbourhood);
    iterates the ids in the KG's row order (every entity, or those with a link when ``linked``)."""

    def __init__(self, kg: CompiledGraph, value: Callable[[int], Any], size: int, linked: bool = False):
        self._kg, self._value, self._linked = kg, lru_cache(maxsize=size)(value), linked

    def __getitem__(self, eid: int) -> Any:
        row = self._kg.row(eid)
        if row < 0:
            raise KeyError(eid)
        return self._value(row)

    def __contains__(self, eid: object) -> bool:
        return isinstance(eid, int | np.integer) and self._kg.row(int(eid)) >= 0

    def _rows(self) -> np.ndarray | None:
        return np.flatnonzero(np.diff(self._kg.offsets)) if self._linked else None

    def __iter__(self) -> Iterator[int]:
        rows = self._rows()
        for a in range(0, len(self._kg) if rows is None else len(rows), 65_536):
            yield from (self._kg.ids[a:a + 65_536] if rows is None else self._kg.ids[rows[a:a + 65_536]]).tolist()

    def __len__(self) -> int:
        rows = self._rows()
        return len(self._kg) if rows is None else len(rows)


class _Names:
    """Folded name -> ids of the entities with that title or alias (a hash index: not iterable)."""

    def __init__(self, kg: CompiledGraph, entities: _ByRow):
        self._kg, self._entities = kg, entities

    def __getitem__(self, name: str) -> list[int]:
        out = []
        for row in self._kg.named(name):
            eid = int(self._kg.ids[row])
            ent = self._entities[eid]
            if name in {fold(ent.title), *(fold(a) for a in ent.aliases)}:  # not a hash collision
                out.append(eid)
        return out

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] or default


class _ValueCounts:
    """Folded answer value -> how many answers of the KG have it (0 when none, as a ``Counter``)."""

    def __init__(self, kg: CompiledGraph):
        self._kg = kg

    def __getitem__(self, value: str) -> int:
        return self._kg.value_count(value)


class Graph:
    """Read-only KG view: ``entities`` by id, raw ``links_from``, deduplicated out-neighbours, anchors.

    Backed by a compiled graph (``osvl.kg.compiled``) that every process of a node maps, so a worker holds
    only the entities it visits. ``entities``, ``links_from`` and ``out`` are read-only mappings by id;
    ``by_name`` and ``value_count`` are hash lookups (no iteration). Built from row dicts (tests), the
    rows are compiled into a temporary folder first: one implementation either way.
    """

    def __init__(self, entities: Iterable[dict[str, Any]], links: Iterable[dict[str, Any]],
                 anchors: Iterable[dict[str, Any]] = (), *, root: str | Path = "", max_answer_words: int = 6):
        rows = list(entities)
        links = list(links)
        self._tmp = tempfile.TemporaryDirectory(prefix="osvl-graph-")  # removed with the graph
        ends = [np.array([int(link[k]) for link in links], dtype=np.int64) for k in ("src", "dst")]
        rel = pa.array([str(link["relation"]) if link["relation"] else None for link in links], pa.string())
        compile_graph(Path(self._tmp.name), [rows], [(ends[0], ends[1], rel)], anchors,
                      partial(_entity, max_words=max_answer_words), strict=False,
                      count_in_degree=not any("in_degree" in r for r in rows))
        self._open(self._tmp.name, root)

    def _open(self, folder: str | Path, root: str | Path) -> None:
        self.root = Path(root) if root else None
        self._kg = kg = CompiledGraph(folder)
        self.bad: Counter[str] = Counter({k: v for k, v in kg.meta["bad"].items() if v})  # skipped rows, by table
        self.entities: Mapping[int, Entity] = _ByRow(kg, partial(_entity_at, kg), 1 << 14)
        self.links_from: Mapping[int, list[tuple[int, str]]] = _ByRow(kg, kg.links, 1 << 12, linked=True)
        self.out: Mapping[int, list[tuple[int, str]]] = _ByRow(
            kg, lambda row: _one_edge_per_neighbour(kg.links(row)), 1 << 14, linked=True)
        self.anchors: dict[int, list[Anchor]] = defaultdict(list)  # a few per seed: plain objects
        for a in kg.anchors:
            self.anchors[a.pop("entity_id")].append(Anchor(**a))
        self.by_name = _Names(kg, self.entities)
        self.value_count = _ValueCounts(kg)

    @classmethod
    def load(cls, kg_dir: str | Path | None = None, *, max_answer_words: int = 6) -> Graph:
        """Open a KG folder (default: the committed sample), compiling it first if no process of this node has."""
        root = Path(kg_dir) if kg_dir is not None else SAMPLE_DIR
        folder = ensure(root, partial(_entity, max_words=max_answer_words), f"max_answer_words={max_answer_words}")
        graph = cls.__new__(cls)
        graph._open(folder, root)
        return graph

    def neighbours(self, eid: int) -> list[int]:
        return [dst for dst, _ in self.out.get(eid, ())]

    def seeds(self, min_score: float = 0.0) -> list[int]:
        """Entities with at least one grounded anchor image scoring ``min_score`` or more."""
        return sorted(e for e, anchors in self.anchors.items()
                      if not self.entities[e].list_page and any(a.score >= min_score for a in anchors))

    def answer_aliases(self, value: str) -> list[str]:
        """Names of the entities the answer value names (so "USA" guards "United States" too)."""
        out: set[str] = set()
        for eid in self.by_name.get(fold(value), ()):
            ent = self.entities[eid]
            out.update([ent.title, *ent.aliases])
        out.discard(value)
        return sorted(out)


SPLIT_CODES = (*SPLITS, "train")
"""``SplitMap`` codes: the splits, and ``train`` (sft + rl) of ``assign_splits``' first round."""


class SplitMap(Mapping[int, str]):
    """Entity id -> split, one byte per entity of the graph (``-1``: none) instead of a dict over millions."""

    def __init__(self, graph: Graph, codes: np.ndarray):
        self._kg, self.codes = graph._kg, codes

    def __getitem__(self, eid: int) -> str:
        row = self._kg.row(eid)
        if row < 0 or self.codes[row] < 0:
            raise KeyError(eid)
        return SPLIT_CODES[self.codes[row]]

    def __iter__(self) -> Iterator[int]:
        yield from self._kg.ids[self.codes >= 0].tolist()

    def __len__(self) -> int:
        return int((self.codes >= 0).sum())


def _unit(*parts: Any) -> float:
    """A deterministic number in [0, 1) from its parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(graph: Graph, seeds: list[int], fractions: dict[str, float],
                  entity_fractions: dict[str, float], run_seed: int, hub_in_degree: int = 300,
                  poor: int = 3, depth: int = 1) -> SplitMap:
    """Give every entity one split: seeds in the exact proportions, their neighbourhoods with them, the rest by hash.

    ``fractions`` and ``entity_fractions`` map split names to shares; a split they leave out gets none.

    With a ``dev`` share the deal takes two rounds: first (sft + rl, heldout, dev), exactly as a three-share
    config deals (sft, rl, heldout), then the first group's seeds and entities into sft and rl. So a
    three-share config's held-out split can become a development split (where settings were tuned on
    figures) and its rl split a held-out one no setting was tuned on, the other seeds staying where they were:
    how the demo profile moved its splits on 2026-12-06 (``_deal`` has the how).
    """
    shares = {s: fractions.get(s, 0.0) for s in SPLITS}
    entity_shares = {s: entity_fractions.get(s, 0.0) for s in SPLITS}
    args = (run_seed, hub_in_degree, poor, depth)
    if shares["dev"] <= 0:
        three = ("sft", "rl", "heldout")
        return _deal(graph, seeds, {s: shares[s] for s in three}, {s: entity_shares[s] for s in three}, *args)
    first = _deal(graph, seeds, *({"train": f["sft"] + f["rl"], "heldout": f["heldout"], "dev": f["dev"]}
                                  for f in (shares, entity_shares)), *args)
    train = first.codes == SPLIT_CODES.index("train")
    if not train.any():  # sft and rl have no share
        return first
    second = _deal(graph, [e for e in seeds if first[e] == "train"],
                   *({"sft": f["sft"] / (f["sft"] + f["rl"]), "rl": f["rl"] / (f["sft"] + f["rl"])}
                     for f in (shares, entity_shares)), *args, domain=train)
    codes = first.codes.copy()
    codes[second.codes >= 0] = second.codes[second.codes >= 0]
    return SplitMap(graph, codes)


def _deal(graph: Graph, seeds: list[int], fractions: dict[str, float], entity_fractions: dict[str, float],
          run_seed: int, hub_in_degree: int, poor: int, depth: int, domain: np.ndarray | None = None) -> SplitMap:
    """One round of ``assign_splits`` over the splits ``fractions`` names (in its order), for every entity of
    ``domain`` (a mask over the graph's rows; default: the whole graph; a second round's, whose seeds share
    their first hops, see below).

    Seeds are few (tens), so they are dealt out to hit the question shares. Then each
    seed claims its out-neighbours for its split, and, up to ``depth`` hops (the longest
    walk), every *poor* entity (at most ``poor`` walkable out-neighbours) claimed so far
    claims its walkable out-neighbours too, level by level, poorest seeds first. Every
    other entity is hashed with ``entity_fractions``.

    Why poor entities only: a walk through an entity with many exits finds some of
    them in its split by hashing alone (the embedded sample's entities have dozens), but
    on a tree-shaped graph (Wikidata: a person's one place of birth, a city's one
    region) the only exit of a hop lands in the seed's split with probability 1/3 per
    hop, and 4-hop walks all but never survive. "Connected groups of questions" would
    be exact, but nearly every seed of a link graph joins one giant group; so only poor
    seeds are grouped: those sharing a walkable neighbour (six paintings that all link
    only to their painter), then those whose poor neighbourhoods meet deeper (two
    cities of one region), always while the group stays within the smallest split's
    share of seeds, so that the split fractions still hold.

    Seeds and their neighbourhoods are few and go through a dict; the hashed rest (nearly every entity of
    a large KG) is written straight into ``SplitMap``'s byte per entity.
    """
    walkable_of: dict[int, list[int]] = {}

    def in_domain(e: int) -> bool:
        return domain is None or bool(domain[graph._kg.row(e)])

    def walkable(e: int) -> list[int]:
        if e not in walkable_of:
            walkable_of[e] = [d for d in graph.neighbours(e)
                              if graph.entities[d].in_degree <= hub_in_degree and not graph.entities[d].list_page]
        return walkable_of[e]

    parent = {e: e for e in seeds}
    size = dict.fromkeys(seeds, 1)

    def root(e: int) -> int:
        while parent[e] != e:
            parent[e] = parent[parent[e]]
            e = parent[e]
        return e

    def union(a: int, b: int, bound: int) -> None:
        ra, rb = root(a), root(b)
        if ra != rb and size[ra] + size[rb] <= bound:
            parent[ra] = rb
            size[rb] += size[ra]

    names = list(fractions)
    positive = [f for f in fractions.values() if f > 0]
    bound = max(2, round(min(positive, default=1.0) * len(seeds)))  # the smallest split's share of seeds
    poor_seeds = [e for e in seeds if len(walkable(e)) <= poor]
    reach = {e: set(walkable(e)) for e in poor_seeds}
    for level in range(1, max(1, depth) + 1):
        sharers: dict[int, list[int]] = defaultdict(list)
        for e in poor_seeds:
            for d in reach[e]:
                sharers[d].append(e)
        if level == 1:  # seeds whose one first hop this is go together, however many (a painter's paintings)
            for d, group in sorted(sharers.items()):
                alone = [e for e in group if walkable(e) == [d]]
                for e in alone[1:]:
                    union(e, alone[0], len(seeds))
        # then the most specific shared entities first (a city before "human", which every person is an
        # instance of and which can never bring all of its seeds into one split)
        for _, group in sorted(sharers.items(), key=lambda kv: (len(kv[1]), kv[0])):
            if 2 <= len(group) <= bound:
                for e in group[1:]:
                    union(e, group[0], bound)
        if level < depth:  # the next ring, entered only through poor entities
            reach = {e: {x for d in r if len(walkable(d)) <= poor for x in walkable(d)} for e, r in reach.items()}
    groups: dict[int, list[int]] = {}
    for e in seeds:
        groups.setdefault(root(e), []).append(e)
    # rich groups first, each to the split furthest below its share after taking it: every split
    # gets its share of rich and of poor seeds, and the totals match the fractions
    order = sorted(groups.values(), key=lambda g: (-sum(len(walkable(e)) for e in g), _unit(run_seed, "seed", g[0])))
    split_of: dict[int, str] = {}
    dealt: Counter[str] = Counter()
    for group in order:
        total = sum(dealt.values()) + len(group)
        name = max(names, key=lambda s: (fractions[s] * total - dealt[s], fractions[s]))
        for e in group:
            split_of[e] = name
        dealt[name] += len(group)
    # the poorest seeds claim first: a rich seed loses little to another split
    frontier = sorted(seeds, key=lambda e: (len(walkable(e)), _unit(run_seed, "seed", e)))
    if domain is not None:
        # A second round's seeds share most of their neighbours (the first round claimed them for the group
        # as a whole), so first come would leave the last seeds nothing (rl got 100 of the group's 5,123
        # entities in the demo's KG): a neighbour of seeds in several splits goes to one of them by hash.
        claimants: dict[int, set[str]] = defaultdict(set)
        for e in seeds:
            for dst in graph.neighbours(e):
                if in_domain(dst) and dst not in split_of:
                    claimants[dst].add(split_of[e])
        for dst, splits in sorted(claimants.items()):
            pick = [n for n in names if n in splits]
            u = _unit(run_seed, "entity", dst) * sum(fractions[n] for n in pick)
            split_of[dst] = next((n for k, n in enumerate(pick) if u < sum(fractions[m] for m in pick[:k + 1])),
                                 pick[-1])
        frontier = sorted(claimants, key=lambda e: (len(walkable(e)), e))
    for level in range(1 if domain is None else 2, max(1, depth) + 1):
        claimed = []
        for e in frontier:
            if level > 1 and len(walkable(e)) > poor:
                continue
            for dst in graph.neighbours(e) if level == 1 else walkable(e):
                if dst not in split_of and in_domain(dst):
                    split_of[dst] = split_of[e]
                    claimed.append(dst)
        frontier = claimed
    codes = np.full(len(graph.entities), -1, dtype=np.int8)
    codes[graph._kg.rows(np.array(list(split_of), dtype=np.int64))] = [SPLIT_CODES.index(s) for s in split_of.values()]
    # every other entity by hash: the first split whose cumulative share exceeds its number, the last split
    # with a share taking rounding's leftover (never a split with no share)
    rest = np.flatnonzero((codes < 0) if domain is None else (codes < 0) & domain)
    u = np.fromiter((_unit(run_seed, "entity", e) for e in graph._kg.ids[rest].tolist()), float, len(rest))
    cums = list(itertools.accumulate(entity_fractions[s] for s in names))  # summed in order, as a loop would
    last = max(k for k, s in enumerate(names) if entity_fractions[s] > 0)
    pick = np.minimum(np.searchsorted(cums, u, side="right"), last)
    codes[rest] = np.array([SPLIT_CODES.index(s) for s in names], dtype=np.int8)[pick]
    return SplitMap(graph, codes)


@dataclass
class Walk:
    entities: list[int]  # seed first
    relations: list[str]  # relations[i] leads from entities[i] to entities[i + 1]
    answer_key: str
    answer: str
    # True: the last entity is the answer ("the country of ..."), the key the relation leading to it, the answer
    # its title; False: the answer is the value of the last entity's attribute ``answer_key``
    answer_entity: bool = False


@dataclass
class WalkConfig:
    hub_in_degree: int = 300
    max_answer_words: int = 6
    entity_answers: bool = True


def askable_relation(graph: Graph, src: int, dst: int, relation: str, max_words: int) -> bool:
    """Whether "the <relation> of <src>" has one answer, ``dst``: a typed relation (not ``linked_to`` nor a type)
    that leads from ``src`` to ``dst`` alone, and a short name that is not a list page's. The answer may be a
    hub (a country, an occupation: most item-valued facts point to one) and in any split: it is a value, not
    a page the question walks through, as an attribute's value is."""
    ent = graph.entities[dst]
    if fold(relation) in TYPE_RELATIONS or ent.list_page or len(ent.title.split()) > max_words or not fold(ent.title):
        return False
    return [d for d, r in graph.links_from.get(src, ()) if r == relation] == [dst]


def random_walk(graph: Graph, seed: int, hops: int, rng: np.random.Generator, split_of: Mapping[int, str],
                cfg: WalkConfig, skips: Counter[str]) -> Walk | None:
    """One constrained walk of ``hops`` hops from ``seed``; None (reason counted in ``skips``) at a dead end."""
    split = split_of[seed]
    path, rels = [seed], []
    for step in range(hops):
        last = step == hops - 1
        options = []
        for dst, rel in graph.out.get(path[-1], ()):
            ent = graph.entities[dst]
            # one hop at least before the asked entity: the answer is read off a page the question describes
            if last and step > 0 and cfg.entity_answers and dst not in path and askable_relation(
                    graph, path[-1], dst, rel, cfg.max_answer_words):
                options.append((dst, rel, True))
            if dst in path:
                skips["cycle"] += 1
            elif ent.in_degree > cfg.hub_in_degree:
                skips["hub"] += 1
            elif ent.list_page:
                skips["list_page"] += 1
            elif split_of.get(dst) != split:
                skips["other_split"] += 1
            elif last and not ent.answers:
                skips["no_answer_attribute"] += 1
            else:
                options.append((dst, rel, False))
        if not options:
            skips[f"dead_end_hop{step + 1}"] += 1
            return None
        dst, rel, asked = options[int(rng.integers(len(options)))]
        path.append(dst)
        rels.append(rel)
        if asked:
            return Walk(path, rels, rel, graph.entities[dst].title, answer_entity=True)
    answers = graph.entities[path[-1]].answers
    weights = np.array([1.0 / max(1, graph.value_count[fold(v)]) for _, v in answers])
    key, value = answers[int(rng.choice(len(answers), p=weights / weights.sum()))]
    return Walk(path, rels, key, value)
