"""A small grammar that words any relation or attribute name as English.

The rewriter writes "the {relation} of X", which reads well for noun-like keys
("the capital of X", "the architect of X") and badly for the labels most
knowledge graphs use: Wikidata property labels are verb and prepositional phrases
("place of birth", "part of", "located in the administrative territorial entity"),
and "the part of of X" is not a question anyone asks. Each relation is worded in
two shapes, both with ``{x}`` standing for the inner phrase:

- ``full``: the relation alone names the entity ("the place where X was born");
- ``clause``: a relative clause that follows another descriptor ("the French
  city *where X was born*").

``TABLE`` holds the common Wikidata properties; ``relation_forms`` falls back to
rules for the rest (noun-like: "the K of X"; ending in a preposition: "the one that
X is K"; starting with a verb: "the one that X K"). Nothing here decides what is
true: the invariant checks still run on the structured path, this only words it.

``clean`` is the last gate every question passes: no identifier-like token
(``P19``, ``Q42``), no underscore and no word twice in a row.
"""

from __future__ import annotations

import re

# label -> (full, clause); "{x}" is the entity the hop starts from, already phrased. When "{x}"
# is not last, a second pair (in NESTED) keeps it last for hops whose "{x}" is itself a clause:
# "the region where [the place where the person in the image was born] is located" nests a
# clause inside a clause; "the region containing the place where ... was born" reads on.
TABLE: dict[str, tuple[str, str]] = {
    "place of birth": ("the place where {x} was born", "where {x} was born"),
    "place of death": ("the place where {x} died", "where {x} died"),
    "place of burial": ("the place where {x} is buried", "where {x} is buried"),
    "part of": ("the whole that {x} is part of", "that {x} is part of"),
    "has part": ("a part of {x}", "that is part of {x}"),
    "has parts": ("a part of {x}", "that is part of {x}"),
    "subclass of": ("the class that {x} is a subclass of", "that {x} is a subclass of"),
    "instance of": ("the class that {x} is an instance of", "that {x} is an instance of"),
    "located in the administrative territorial entity": ("the administrative region where {x} is located",
                                                          "where {x} is located"),
    "contains the administrative territorial entity": ("a subdivision of {x}", "that lies within {x}"),
    "located in": ("the place where {x} is located", "where {x} is located"),
    "located in or next to body of water": ("the body of water {x} lies in or next to",
                                            "that {x} lies in or next to"),
    "located on terrain feature": ("the terrain feature {x} is located on", "that {x} is located on"),
    "country of origin": ("the country {x} comes from", "that {x} comes from"),
    "country of citizenship": ("the country {x} is a citizen of", "that {x} is a citizen of"),
    "member of": ("the organization {x} is a member of", "that {x} is a member of"),
    "educated at": ("the school where {x} was educated", "where {x} was educated"),
    "founded by": ("the founder of {x}", "that founded {x}"),
    "named after": ("the namesake of {x}", "that {x} is named after"),
    "follows": ("the predecessor of {x}", "that {x} follows"),
    "followed by": ("the successor of {x}", "that follows {x}"),
    "replaces": ("what {x} replaced", "that {x} replaced"),
    "replaced by": ("what replaced {x}", "that replaced {x}"),
    "owned by": ("the owner of {x}", "that owns {x}"),
    "capital of": ("the country whose capital is {x}", "whose capital is {x}"),
    "shares border with": ("a neighbour of {x}", "that borders {x}"),
    "participant in": ("the event {x} took part in", "that {x} took part in"),
    "depicts": ("what {x} depicts", "that {x} depicts"),
    "made from material": ("the material {x} is made from", "that {x} is made from"),
    "material used": ("the material {x} is made from", "that {x} is made from"),
    "headquarters location": ("the place where {x} has its headquarters", "where {x} has its headquarters"),
    "mouth of the watercourse": ("the water {x} flows into", "that {x} flows into"),
    "linked to": ("the page linked from the article on {x}", "mentioned in the article on {x}"),  # linked_to
}
NESTED: dict[str, tuple[str, str]] = {
    "place of birth": ("the birthplace of {x}", "that is the birthplace of {x}"),
    "place of death": ("the place of death of {x}", "that is the place of death of {x}"),
    "place of burial": ("the burial place of {x}", "that is the burial place of {x}"),
    "part of": ("the whole containing {x}", "containing {x}"),
    "subclass of": ("the superclass of {x}", "that is the superclass of {x}"),
    "instance of": ("the class of {x}", "that is the class of {x}"),
    "located in the administrative territorial entity": ("the administrative region containing {x}",
                                                          "containing {x}"),
    "located in": ("the place containing {x}", "containing {x}"),
    "located in or next to body of water": ("the body of water beside {x}", "beside {x}"),
    "located on terrain feature": ("the terrain feature under {x}", "under {x}"),
    "country of origin": ("the country of origin of {x}", "that is the country of origin of {x}"),
    "country of citizenship": ("the country of citizenship of {x}", "that is the country of citizenship of {x}"),
    "member of": ("the organization with {x} as a member", "with {x} as a member"),
    "educated at": ("the school of {x}", "that is the school of {x}"),
    "named after": ("the namesake of {x}", "that gave its name to {x}"),
    "follows": ("the predecessor of {x}", "that precedes {x}"),
    "replaces": ("the predecessor of {x}", "that was replaced by {x}"),
    "participant in": ("the event with {x} as a participant", "with {x} as a participant"),
    "depicts": ("the subject of {x}", "depicted by {x}"),
    "made from material": ("the material of {x}", "used in {x}"),
    "material used": ("the material of {x}", "used in {x}"),
    "headquarters location": ("the headquarters of {x}", "that is the headquarters of {x}"),
    "mouth of the watercourse": ("the mouth of {x}", "at the mouth of {x}"),
}

PREPOSITIONS = {"of", "in", "by", "after", "at", "on", "from", "to", "with", "for", "into", "as", "under",
                "over", "about", "between", "within", "near", "through"}
VERBS = {"has", "have", "contains", "depicts", "shares", "uses", "follows", "replaces", "owns", "produces",
         "operates", "connects", "crosses", "borders", "is", "was", "influenced", "influences", "flows"}

_ID = re.compile(r"\b[PQL]\d+\b", re.IGNORECASE)
_DOUBLED = re.compile(r"\b(\w+)\s+\1\b", re.IGNORECASE)
_READABLE = re.compile(r"^[^\W\d_](?:[^\W\d_]|['\- ])*$")


def label(key: str) -> str:
    """A relation or attribute key as words: underscores to spaces, whitespace collapsed."""
    return " ".join(key.replace("_", " ").split())


def lower_first(text: str) -> str:
    # "Painting by Seurat" -> "painting by Seurat", but keep "UNESCO site", "GDP (PPP)" and "Italian city"
    if len(text) > 1 and text[0].isupper() and text[1].islower() and text.split()[0].lower() not in _PROPER:
        return text[0].lower() + text[1:]
    return text


# Leading words that stay capitalised (nationalities and languages are the common case in short descriptions).
_PROPER = {"american", "british", "english", "french", "german", "italian", "spanish", "chinese", "japanese",
           "indian", "russian", "greek", "roman", "dutch", "australian", "canadian", "scottish", "irish",
           "african", "european", "asian", "egyptian", "mexican", "brazilian", "swedish", "norwegian"}


def _article(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def relation_forms(relation: str, nested: bool = False) -> tuple[str, str]:
    """(full, clause) templates over ``{x}`` for a relation name (see the module docstring).

    ``nested``: the inner phrase ends in a clause of its own; prefer forms that end in ``{x}``.
    """
    rel = label(relation)
    folded = rel.lower()
    if nested and folded in NESTED:
        return NESTED[folded]
    if folded in TABLE:
        return TABLE[folded]
    words, rel = folded.split(), lower_first(rel)
    if words and words[0] in VERBS:
        return f"the one that {{x}} {rel}", f"that {{x}} {rel}"
    if len(words) >= 2 and words[-1] in PREPOSITIONS:
        # "member of" -> "is a member of"; "named after", "located near" are participles and take no article
        body = _article(rel) if words[-1] == "of" and len(words) == 2 and not words[0].endswith("ed") else rel
        return f"the one that {{x}} is {body}", f"that {{x}} is {body}"
    return f"the {rel} of {{x}}", f"that is the {rel} of {{x}}"


def relation_phrase(relation: str, inner: str, nested: bool = False) -> str:
    """The hop named by its relation alone: "the place where the person in the image was born"."""
    return relation_forms(relation, nested)[0].format(x=inner)


def relation_clause(descriptor: str, relation: str, inner: str, nested: bool = False) -> str:
    """A descriptor tied to the previous entity: "the French city where the person in the image was born"."""
    return f"{descriptor} {relation_forms(relation, nested)[1].format(x=inner)}"


def attribute_phrase(key: str, value: str) -> str:
    """A descriptor from an attribute: "the one whose population is 2,100"."""
    rel = lower_first(label(key))
    words = rel.lower().split()
    if words and (words[0] in VERBS or (len(words) >= 2 and words[-1] in PREPOSITIONS)):
        return f"the one that {rel} {value}" if words[0] in VERBS else f"the one {rel} {value}"
    return f"the one whose {rel} is {value}"


def question(answer_key: str, inner: str, nested: bool = False, key_case: str = "lower") -> str:
    """The final question: what the answer attribute of the last entity is.

    ``key_case="kg"`` spells the key as the KG stores it ("What is the Field of ..."): the same tokens as
    the "Field: ..." line of the result the answer is read from, which a policy that copies by token can
    find by the key (``lower``, the default, reads as English: "the field of")."""
    text = relation_phrase(answer_key.lower(), inner, nested)
    if key_case == "kg":
        text = text.replace(label(answer_key).lower(), label(answer_key), 1)
    return f"What is {text}?"


def readable(text: str) -> bool:
    """Whether a category leaf or relation reads as words (not ``P31``, ``1990s_births`` or a code)."""
    words = label(text)
    return bool(words) and len(words.split()) <= 6 and bool(_READABLE.match(words)) and not _ID.search(words)


def clean(text: str) -> str:
    """Why ``text`` may not appear in a question ("" when it may): an id-like token, an underscore, a doubled word."""
    if _ID.search(text):
        return "id_token"
    if "_" in text:
        return "underscore"
    if _DOUBLED.search(text):
        return "doubled_word"
    return ""
