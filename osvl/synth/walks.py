"""The KG as synthesis sees it, and constrained random walks over it.

``Graph`` is a read-only view of the KG (``osvl.kg.schema.load_kg``) holding only what
synthesis needs, precomputed once per worker: names, short descriptions,
categories, answerable attributes, deduplicated adjacency and value frequencies.
It can also be built from plain lists of row dicts, which is how unit tests make
graphs of a dozen entities.

A walk starts at a *seed* (an entity with a grounded anchor image), takes ``h``
hops along out-links and ends at an entity with an answerable attribute. The
constraints and why:

- hubs (in-degree above a threshold) are skipped: "the country linked from the
  article on X" is never a unique referent when X links to 200 countries, and
  hub paths make every question look alike;
- list, index and disambiguation pages are skipped: they are not things;
- no entity twice (no cycles): a question that returns to its start is trivial;
- every entity of the walk belongs to the seed's split (``assign_splits``), which
  is how "no path entity in two splits" holds by construction while shards run
  independently (a seed's sparse neighbourhood, up to the walk depth, joins its split);
- the last hop only goes to entities with an eligible answer attribute, and the
  attribute is drawn with weight 1 / (how many entities share that value), so
  that frequent values ("Animalia", "English") do not swamp the answers.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

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
TYPE_RELATIONS = {"instance of", "subclass of", "linked_to"}
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


class Graph:
    """Read-only KG view: ``entities`` by id, raw ``links_from``, deduplicated out-neighbours, anchors."""

    def __init__(self, entities: Iterable[dict[str, Any]], links: Iterable[dict[str, Any]],
                 anchors: Iterable[dict[str, Any]] = (), *, root: str | Path = "", max_answer_words: int = 6):
        self.root = Path(root) if root else None
        self.entities: dict[int, Entity] = {}
        self.bad: Counter[str] = Counter()  # malformed rows skipped, by table
        rows = list(entities)
        for row in rows:
            try:
                eid = int(row["id"])
                attrs = [dict(a) for a in (row.get("attributes") or [])]
                ent = Entity(
                    id=eid, title=str(row["title"]), aliases=[str(a) for a in (row.get("aliases") or [])],
                    description=str(row.get("description") or ""),
                    categories=[str(c) for c in (row.get("categories") or [])],
                    attributes=[(str(a["key"]), str(a["value"])) for a in attrs],
                    answers=_answers(attrs, max_answer_words), list_page=_is_list_page(row),
                    in_degree=int(row.get("in_degree") or 0))
            except (KeyError, TypeError, ValueError, AttributeError):
                self.bad["entity"] += 1  # one broken page must not stop a run over millions
                continue
            ent.folded_attributes = {(fold(k), fold(v)) for k, v in ent.attributes}
            self.entities[eid] = ent
        self.links_from: dict[int, list[tuple[int, str]]] = defaultdict(list)
        in_count: Counter[int] = Counter()
        for link in links:
            src, dst, rel = int(link["src"]), int(link["dst"]), str(link["relation"] or "linked_to")
            if src in self.entities and dst in self.entities and src != dst:
                self.links_from[src].append((dst, rel))
                in_count[dst] += 1
            else:
                self.bad["link"] += 1
        if not any("in_degree" in r for r in rows):
            for eid, ent in self.entities.items():
                ent.in_degree = in_count[eid]
        # one edge per neighbour for walking; a typed relation beats ``linked_to`` because it words better
        self.out: dict[int, list[tuple[int, str]]] = {}
        for src, pairs in self.links_from.items():
            best: dict[int, str] = {}
            for dst, rel in sorted(pairs):
                if dst not in best or (best[dst] == "linked_to" and rel != "linked_to"):
                    best[dst] = rel
            self.out[src] = sorted(best.items())
        self.anchors: dict[int, list[Anchor]] = defaultdict(list)
        for a in anchors:
            eid = int(a["entity_id"])
            if eid in self.entities:
                self.anchors[eid].append(Anchor(str(a["image"]), str(a.get("caption") or ""),
                                                str(a.get("source") or ""), str(a.get("licence") or ""),
                                                float(a.get("score") or 0.0), str(a.get("scorer") or "")))
        self.by_name: dict[str, list[int]] = defaultdict(list)
        for eid, ent in self.entities.items():
            for name in {fold(ent.title), *(fold(a) for a in ent.aliases)}:
                if name:
                    self.by_name[name].append(eid)
        self.value_count: Counter[str] = Counter(fold(v) for e in self.entities.values() for _, v in e.answers)

    @classmethod
    def load(cls, kg_dir: str | Path | None = None, *, max_answer_words: int = 6) -> Graph:
        """Read a KG folder through ``osvl.kg.schema.load_kg`` (default: the committed sample)."""
        from osvl.kg.schema import load_kg

        kg = load_kg(kg_dir)
        links = ({"src": s, "dst": d, "relation": r} for s, pairs in kg.out_links.items() for d, r in pairs)
        anchors = (a for rows in kg.anchors.values() for a in rows)
        return cls(kg.entities.values(), links, anchors, root=kg.root, max_answer_words=max_answer_words)

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


def _unit(*parts: Any) -> float:
    """A deterministic number in [0, 1) from its parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(graph: Graph, seeds: list[int], fractions: dict[str, float],
                  entity_fractions: dict[str, float], run_seed: int, hub_in_degree: int = 300,
                  poor: int = 3, depth: int = 1) -> dict[int, str]:
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
    train = {e for e, s in first.items() if s == "train"}
    if not train:  # sft and rl have no share
        return first
    second = _deal(graph, [e for e in seeds if e in train],
                   *({"sft": f["sft"] / (f["sft"] + f["rl"]), "rl": f["rl"] / (f["sft"] + f["rl"])}
                     for f in (shares, entity_shares)), *args, domain=train)
    return {**first, **second}


def _deal(graph: Graph, seeds: list[int], fractions: dict[str, float], entity_fractions: dict[str, float],
          run_seed: int, hub_in_degree: int, poor: int, depth: int, domain: set[int] | None = None) -> dict[int, str]:
    """One round of ``assign_splits`` over the splits ``fractions`` names (in its order), for every entity of
    ``domain`` (default: the whole graph; a second round's, whose seeds share their first hops, see below).

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
    """
    walkable_of: dict[int, list[int]] = {}

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
                if dst in domain and dst not in split_of:
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
                if dst not in split_of and (domain is None or dst in domain):
                    split_of[dst] = split_of[e]
                    claimed.append(dst)
        frontier = claimed
    last = [s for s in names if entity_fractions[s] > 0][-1]  # rounding's leftover: never a split with no share
    for eid in graph.entities if domain is None else sorted(domain):
        if eid in split_of:
            continue
        u, cum = _unit(run_seed, "entity", eid), 0.0
        for name in names:
            cum += entity_fractions[name]
            if u < cum or name == last:
                split_of[eid] = name
                break
    return split_of


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


def random_walk(graph: Graph, seed: int, hops: int, rng: np.random.Generator, split_of: dict[int, str],
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
