"""Fuzzy rewriting: a walk becomes a question that names nothing on its path.

Back to front, one entity at a time, each entity after the start is replaced by a
*descriptor* drawn from the KG: its short description ("the 1968 film by Stanley
Kubrick"), a category ("the one listed under Artists"), a distinctive attribute
("the one whose capital is Nairobi"), or only its relation to its neighbour ("the
architect of ...", "the place where ... was born"; ``osvl.synth.phrasing`` words any
relation name, and descriptors with ids, codes or underscores are never offered).
A descriptor is kept only if, among everything its predecessor links to, exactly one
entity satisfies it, and if it names no path
entity and not the answer; otherwise the next option is tried. The start entity
becomes a visual reference chosen by its category ("the animal shown").

The template rewriter is the default: deterministic, fast, and correct by
construction. The LLM rewriter (any OpenAI-compatible chat-completions endpoint)
only rephrases the template question for fluency; since code cannot prove that a
paraphrase kept the meaning, its output is accepted only if the answer key and
every descriptor value still occur in it and it leaks nothing, else the template stands and the
fallback is counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from osvl.endpoint import ChatClient, EndpointConfig
from osvl.errors import ConfigError
from osvl.synth.invariants import descriptor_holds, fold, guarded_forms, leaked, step_candidates
from osvl.synth.phrasing import (
    attribute_phrase,
    clean,
    label,
    lower_first,
    question,
    readable,
    relation_clause,
    relation_forms,
    relation_phrase,
)
from osvl.synth.walks import Graph, Walk

# (category/description keyword, visual reference); first match wins, checked on folded text
VISUAL_NOUNS = [
    (("animal", "mammal", "bird", "reptile", "insect", "fish", "amphibian", "dinosaur", "species"),
     "the animal shown"),
    (("plant", "tree", "flower"), "the plant in the image"),
    (("painting", "sculpture", "artwork", "visual arts", "art "), "the artwork in the image"),
    (("building", "architecture", "tower", "bridge", "church", "cathedral", "temple", "palace", "castle",
      "monument", "mosque", "wall", "stadium"), "the building in the image"),
    (("people", "person", "artist", "musician", "writer", " human "), "the person in the image"),
    (("geography", "city", "cities", "country", "countries", "mountain", "river", "lake", "island",
      "region", "places"), "the place shown in the image"),
]
DEFAULT_VISUAL = "the subject of the image"


def visual_reference(graph: Graph, eid: int) -> str:
    ent = graph.entities[eid]
    text = " " + " ".join(fold(c) for c in [ent.description, *ent.categories]) + " "
    for keywords, phrase in VISUAL_NOUNS:
        if any(k in text for k in keywords):
            return phrase
    return DEFAULT_VISUAL


@dataclass
class Descriptor:
    kind: str  # description | category | attribute | relation
    key: str
    value: str


def descriptor_phrase(d: Descriptor) -> str:
    if d.kind == "description":
        return "the " + lower_first(d.value)
    if d.kind == "category":
        leaf = label(category_leaf(d.value))
        # a lowercase leaf is a class name (Wikidata "city"): "the city"; a catalogue heading is not
        return f"the {leaf}" if leaf.islower() else f"the one listed under {leaf}"
    if d.kind == "attribute":
        return attribute_phrase(d.key, d.value)
    return relation_phrase(d.key, "")


def category_leaf(category: str) -> str:
    """``subject.People.Historical_figures`` -> ``Historical_figures`` (Wikispeedia paths end in the leaf)."""
    return category.split(".")[-1]


def hop_phrase(d: Descriptor, relation: str, inner: str, nested: bool = False) -> str:
    """How entity i is described relative to entity i-1 (already phrased as ``inner``; ``nested`` past hop 1)."""
    if d.kind == "relation":
        return relation_phrase(relation, inner, nested)
    return relation_clause(descriptor_phrase(d), relation, inner, nested)


def descriptor_options(graph: Graph, eid: int, relation: str) -> list[Descriptor]:
    """Descriptors that could name ``eid``; only those that read as words (no ids, codes or underscores)."""
    ent = graph.entities[eid]
    out = []
    if ent.description.strip():
        out.append(Descriptor("description", "", ent.description.strip()))
    out.extend(Descriptor("category", "", c) for c in ent.categories if readable(category_leaf(c)))
    out.extend(Descriptor("attribute", k, v) for k, v in ent.answers)
    if relation != "linked_to":
        out.append(Descriptor("relation", relation, ""))
    return [d for d in out if not clean(descriptor_phrase(d))]


def unique_referent(graph: Graph, prev: int, relation: str, eid: int, d: Descriptor) -> bool:
    matches = [x for x in step_candidates(graph, prev, relation) if descriptor_holds(graph, x, d.kind, d.key, d.value)]
    return matches == [eid]


@dataclass
class Draft:
    """A rewritten walk: the question text and its structured form (the output row's ``path``)."""

    question: str
    path: list[dict[str, Any]]
    answer_key: str
    answer: str
    answer_aliases: list[str]


def template_rewrite(graph: Graph, walk: Walk, rng: np.random.Generator, drops: Counter[str],
                     key_case: str = "lower") -> Draft | None:
    """Rewrite ``walk`` back to front; None (reason counted) when some hop has no safe unique descriptor.
    ``key_case``: how the question spells the answer key (``osvl.synth.phrasing.question``)."""
    ids = walk.entities
    aliases = graph.answer_aliases(walk.answer)
    if walk.answer_entity:  # its own aliases first, then those of every entity of that name
        own = graph.entities[ids[-1]].aliases
        aliases = [*own, *(a for a in aliases if a not in own)]
    forms = guarded_forms(graph, ids, walk.answer, aliases)
    described = ids[:-1] if walk.answer_entity else ids  # an asked entity is named by the question's key
    chosen: list[Descriptor] = []
    for i in range(len(described) - 1, 0, -1):
        rel = walk.relations[i - 1]
        options = descriptor_options(graph, ids[i], rel)
        rng.shuffle(options)
        pick = None
        for d in options:
            if leaked(descriptor_phrase(d) + " " + d.key, forms):
                continue
            if unique_referent(graph, ids[i - 1], rel, ids[i], d):
                pick = d
                break
        if pick is None:
            drops[f"no_unique_descriptor_hop{i}"] += 1
            return None
        chosen.append(pick)
    chosen.reverse()  # chosen[i - 1] now describes ids[i]
    phrase = visual_reference(graph, ids[0])
    for i in range(1, len(described)):
        phrase = hop_phrase(chosen[i - 1], walk.relations[i - 1], phrase, nested=i > 1)
    text = question(walk.answer_key, phrase, nested=True, key_case=key_case)
    if why := clean(text):  # e.g. a description ending in the word the relation starts with
        drops[f"unreadable_{why}"] += 1
        return None
    path = [{"entity_id": ids[0], "title": graph.entities[ids[0]].title, "relation": "",
             "descriptor_kind": "visual", "descriptor_key": "", "descriptor_value": visual_reference(graph, ids[0])}]
    for i in range(1, len(ids)):
        d = chosen[i - 1] if i < len(described) else Descriptor("answer", "", "")
        path.append({"entity_id": ids[i], "title": graph.entities[ids[i]].title, "relation": walk.relations[i - 1],
                     "descriptor_kind": d.kind, "descriptor_key": d.key, "descriptor_value": d.value})
    return Draft(text, path, walk.answer_key, walk.answer, aliases)


PROMPT = ("Rewrite the question below so it reads naturally, as a curious person would ask it. Keep every "
          "descriptive phrase and its meaning; do not add any name, hint or answer. Reply with the question only."
          "\n\nQuestion: {question}")


def _kept_descriptors(text: str, draft: Draft) -> bool:
    """Every descriptor value, typed relation and the answer key still occur in the paraphrase."""
    padded = f" {fold(text)} "
    if f" {fold(draft.answer_key)} " not in padded:
        return False
    for step in draft.path[1:]:
        if step["descriptor_kind"] == "answer":  # asked for by the key, checked above
            continue
        if step["descriptor_kind"] == "relation":  # the template's fixed words: "the place where", "was born"
            forms = [relation_forms(step["relation"], nested)[0].split("{x}") for nested in (False, True)]
        elif step["descriptor_kind"] == "category":
            forms = [[label(category_leaf(step["descriptor_value"]))]]
        else:
            forms = [[step["descriptor_value"]]]
        if not any(all(not fold(v) or f" {fold(v)} " in padded for v in values) for values in forms):
            return False
    return True


async def _llm_all(cfg: EndpointConfig, questions: list[str], temperature: float) -> list[str | BaseException]:
    client = ChatClient(cfg, "rewriter.endpoint")
    try:
        return await asyncio.gather(*(client.complete([{"role": "user", "content": PROMPT.format(question=q)}],
                                                      temperature) for q in questions), return_exceptions=True)
    finally:
        await client.close()


def llm_rewrite(cfg: EndpointConfig, graph: Graph, drafts: list[Draft], counts: Counter[str],
                temperature: float = 0.7) -> list[str]:
    """Paraphrase each draft's question concurrently; a rewrite that fails a check, or whose request still
    fails after the client's retries, keeps the template."""
    replies = asyncio.run(_llm_all(cfg, [d.question for d in drafts], temperature))
    out = []
    for draft, reply in zip(drafts, replies, strict=True):
        if isinstance(reply, ConfigError):
            raise reply
        if isinstance(reply, BaseException):
            counts["llm_error"] += 1
            out.append(draft.question)
            continue
        text = " ".join(reply.split())
        ids = [p["entity_id"] for p in draft.path]
        if not text or leaked(text, guarded_forms(graph, ids, draft.answer, draft.answer_aliases)):
            counts["llm_leak"] += 1
            out.append(draft.question)
        elif not _kept_descriptors(text, draft):
            counts["llm_dropped_descriptor"] += 1
            out.append(draft.question)
        else:
            counts["llm_used"] += 1
            out.append(text)
    return out
