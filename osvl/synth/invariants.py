"""The three checks every emitted question passes, done by code against the KG.

A synthesized question is only as good as the promise that it has one answer and
gives nothing away. Each question carries its *structured form* (the path: start
entity, then per hop the relation followed and the descriptor that replaced the
entity's name), and this module re-derives everything from that form and the
graph, never trusting what the rewriter believed:

- **answer invariance**: walking the structured form from the start entity over
  the KG reaches the recorded final entity, whose attribute ``answer_key`` has
  exactly the recorded value; or, when the last step is the asked entity itself
  (descriptor kind ``answer``: "the country of ..."), whose name is the answer,
  reached over the relation ``answer_key`` as its predecessor's only link of it;
- **unique referent**: at every hop exactly one entity satisfies the descriptor
  among the entities its predecessor links to (all of them: hubs, list pages and
  other splits count here, because a solver does not know our walk filters);
- **zero leakage**: no title or alias of any path entity, nor the answer or its
  aliases, occurs in the question text, matched on word boundaries of accent- and
  case-folded text. A title's parenthetical disambiguator is also dropped and the
  bare name checked ("Mercury (planet)" leaks as "Mercury").

The same functions run inside the pipeline (a question failing any check is
dropped and counted) and are re-implemented independently in the tests, which
read the output with pyarrow alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from osvl.kg.schema import fold as kg_fold

if TYPE_CHECKING:
    from osvl.synth.walks import Graph

_PAREN = re.compile(r"\s*\([^)]*\)\s*")
_NON_WORD = re.compile(r"[\W_]+")


def fold(text: str) -> str:
    """``osvl.kg.schema.fold`` (the one folding every module matches names with), with an ASCII fast path.

    Synthesis folds every attribute string of the KG at each worker start; for ASCII text
    the Unicode decomposition is the identity and ``lower`` equals ``casefold``, so the fast
    path gives identical results (a test compares the two) for a fraction of the time
    (docs/measurements.md).
    """
    if text.isascii():
        return _NON_WORD.sub(" ", text.lower()).strip()
    return kg_fold(text)


def name_forms(names: Iterable[str]) -> set[str]:
    """Folded forms of names to guard: each name, and each name without its parenthetical part."""
    out = set()
    for name in names:
        for form in (name, _PAREN.sub(" ", name)):
            folded = fold(form)
            if folded:
                out.add(folded)
    return out


def leaked(text: str, forms: set[str]) -> list[str]:
    """The guarded forms that occur in ``text`` as whole words (sorted, for stable reports)."""
    padded = f" {fold(text)} "
    return sorted(f for f in forms if f" {f} " in padded)


def descriptor_holds(graph: Graph, eid: int, kind: str, key: str, value: str) -> bool:
    """Whether entity ``eid`` satisfies a descriptor (``relation`` ones constrain only the edge)."""
    ent = graph.entities[eid]
    if kind in ("relation", "answer"):  # an asked entity is not described: the relation alone must single it out
        return True
    if kind == "description":
        return fold(ent.description) == fold(value) and bool(fold(value))
    if kind == "category":
        return value in ent.categories
    if kind == "attribute":
        return (fold(key), fold(value)) in ent.folded_attributes
    raise ValueError(f"unknown descriptor kind {kind!r}")


def step_candidates(graph: Graph, prev: int, relation: str) -> list[int]:
    """Entities a hop from ``prev`` may reach: any out-link for ``linked_to``, else links of that relation."""
    if relation == "linked_to":
        return graph.neighbours(prev)
    return sorted({dst for dst, rel in graph.links_from.get(prev, ()) if rel == relation})


def resolve(graph: Graph, path: list[dict[str, Any]]) -> tuple[int | None, str]:
    """Follow a structured path from its start entity; returns (final entity, "") or (None, why)."""
    cur = path[0]["entity_id"]
    if cur not in graph.entities:
        return None, "unknown_start"
    for hop, step in enumerate(path[1:], start=1):
        matches = [x for x in step_candidates(graph, cur, step["relation"])
                   if descriptor_holds(graph, x, step["descriptor_kind"], step["descriptor_key"],
                                       step["descriptor_value"])]
        if len(matches) != 1:
            return None, f"non_unique_hop{hop}" if matches else f"no_referent_hop{hop}"
        cur = matches[0]
    return cur, ""


def guarded_forms(graph: Graph, path_ids: Iterable[int], answer: str, answer_aliases: Iterable[str]) -> set[str]:
    names: list[str] = [answer, *answer_aliases]
    for eid in path_ids:
        ent = graph.entities[eid]
        names.append(ent.title)
        names.extend(ent.aliases)
    return name_forms(names)


def violations(graph: Graph, row: dict[str, Any]) -> list[str]:
    """Every invariant the question ``row`` (an output row) breaks; empty means it may be emitted."""
    path = row["path"]
    problems = []
    final, why = resolve(graph, path)
    if final is None:
        problems.append(why)
    elif final != path[-1]["entity_id"]:
        problems.append("answer_changed")
    elif path[-1]["descriptor_kind"] == "answer":  # the entity is the answer: its name, the key its relation
        if fold(graph.entities[final].title) != fold(row["answer"]) or fold(path[-1]["relation"]) != fold(
                row["answer_key"]):
            problems.append("answer_changed")
    else:
        values = graph.entities[final].attribute_values(row["answer_key"])
        if values != [fold(row["answer"])]:
            problems.append("answer_changed")
    ids = [p["entity_id"] for p in path]
    if any(i not in graph.entities for i in ids):
        problems.append("unknown_entity")
        return problems
    leaks = leaked(row["question"], guarded_forms(graph, ids, row["answer"], row["answer_aliases"]))
    if leaks:
        problems.append("leak")
    return problems
