"""The offline path-oracle teacher: expert trajectories without a large model.

A synthesized question comes with the KG path it was made from (``path``: the pictured
entity, then one entity per hop, the answer an attribute of the last one) and, for a
degraded image, the tool that undoes the degradation. The oracle knows all of it, but it
may *act* only through the real tools and may *say* only what the conversation shows:

- it restores a degraded image first (``degradation.undo_tool`` on ``img_1``), then
  reverse-searches the image, then walks the path with ``text_search`` hop by hop;
- every name in a query, a thought or the answer is a span copied from the question or
  from an earlier tool response, found by parsing the conversation it is handed (never
  from the path it knows): the student learns to read names off tool responses, which is
  the skill the recipe is about, and no trajectory shows knowledge it could not have;
- the path only tells the oracle which span to copy and when a hop is done (the hop's
  entity shows up in a response); a hop whose entity does not show up after a few
  queries makes it give up with a non-answer, which the answer judge then filters out;
- one option breaks the rule on purpose (``recall``): a matching question answered from memory in
  the first turn, as a large teacher does for facts it knows, to give a student a habit to unlearn.

Queries are built from the question's own descriptor phrases ("the one whose Capital is
Nairobi" -> ``Capital Nairobi``; "the rock formed through ..." -> the description) and
the previous hop's name, worded and ordered differently per rollout: a hop whose
descriptor identifies its entity on its own (a description or an attribute) may be
searched before the hop that leads to it. Every turn is ``<think>short reason</think>``
plus one action, built with ``osvl.chat``.

The teacher is a ``ChatEngine`` bound to one question (``PathOracle(row, seed)``) and is
stateless across calls: ``chat`` re-derives everything from the messages, so the same
conversation always gets the same next turn.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from osvl.agent.engines.base import Sampling
from osvl.chat import assistant_text, parse_turn
from osvl.config import opt
from osvl.errors import ConfigError, DataError, ParseError

GIVE_UP = "I could not find the answer with the tools."
"""The oracle's response when the path breaks; never judged correct, so it never reaches SFT data."""

_TOOL_NAMES = ("crop", "sharpen", "super_resolution", "perspective_correct", "ocr", "text_search", "image_search")


@dataclass
class OracleConfig:
    attempts_per_hop: int = opt(3, "Queries the oracle tries for one hop before it gives up.")
    image_attempts: int = opt(2, "Reverse image searches (restored image, then the original) before giving up.")
    reorder_prob: float = opt(0.3, "Chance to search a self-identifying later hop (description/attribute) first.")
    top_k: int = opt(5, "top_k of the oracle's search calls.")
    retry_top_k: int = opt(10, "top_k of a hop's retries: read further down the list when the first query did not "
                               "name the entity.")
    think: Literal["full", "brief"] = opt(
        "full", "'full': a reason per turn naming what was found and what comes next; 'brief': one fixed phrase "
                "per action (BRIEF_THINK), for students too small to copy each name twice a turn.")
    wording: Literal["varied", "fixed"] = opt(
        "varied", "'varied': each query and thought is one of a few wordings, drawn per rollout; 'fixed': always "
                  "the first (best) one and no swaps, so one question has one demonstration (with reorder_prob 0).")
    copy_space: bool = opt(
        False, "Write a space before every query and answer, so that a name copied from the question or a tool "
               "response is the same tokens as its source under a byte-level BPE that glues a space to the next "
               "word (GPT-2 style; the tiny model's). Searches and the answer judge ignore the space.")
    in_order: bool = opt(
        False, "Search every hop in path order, one search each, even when an earlier response already names "
               "its entity: which clause the next query copies is then a function of the question alone, not of "
               "what a snippet happened to mention (a small student cannot learn the latter).")
    look_up: bool = opt(
        False, "After the last hop, always search for the answer (the key and the last hop's descriptor as the "
               "question spells them), even when a response already shows it: every episode then answers right "
               "after that search, so when to answer follows from the turns, not from reading the responses.")
    look_up_top_k: int = opt(
        0, "top_k of the look-up search (0: top_k). 1 leaves one 'Key: value' line of the asked key in the "
           "latest response, the one the answer is read from, instead of one per result (top_k 3: three "
           "'Area:' lines for a small student to choose from). Should the best result not show the answer, "
           "the next answer query runs at top_k.")
    verbatim: bool = opt(
        False, "Search an attribute hop with its clause as the question spells it ('currency is CFP franc (XPF)') "
               "instead of key and value joined ('currency CFP franc (XPF)'): every query piece is then one "
               "contiguous span of the conversation, a pure copy for a small student (whose induction head "
               "predicts ' is' after the key, docs/design.md, 'The demo policy').")
    quote: bool = opt(
        False, "The answer turn's thought ends with the response line the answer is read from, as the response "
               "spells it ('... Field: Zoology, medicine, botany'): the answer is then read at its key, the way a "
               "small student copies a value after 'key:', and copied again from the quote. The thought starts "
               "as without it, so the decision to answer is its first word, not the key.")
    recall: float = opt(
        0.0, "Chance that the teacher answers a question that recall_match finds from memory, in its first turn, "
             "without a tool: the one place it says what the conversation does not show (the path's answer). A "
             "large teacher does this for facts it knows; its answers are right, and a student that cannot know "
             "them learns to guess (docs/design.md, 'A teacher that answers from memory'). Each rollout draws for "
             "itself, so where the trajectories job keeps the best of two rollouts (a search that answers earns "
             "more), recall**2 of the kept ones answer from memory. They make no query (r_query 0): keeping them "
             "takes the process filter off (min_r_query 0).")
    recall_match: str = opt(
        "", "Regular expression (re.search, case aside) a question must match to be answered from memory; empty: "
            "every question.")

    def recall_pattern(self) -> re.Pattern[str]:
        """``recall_match`` compiled; a pattern that is not a regular expression is a ConfigError (the trajectories
        job checks it at start, before any actor builds an oracle)."""
        try:
            return re.compile(self.recall_match, flags=re.IGNORECASE)
        except re.error as e:
            raise ConfigError(f"teacher.oracle.recall_match {self.recall_match!r} is not a regular expression: "
                              f"{e}") from e


# The whole <think> of a turn under think="brief", by action. A toy-scale simplification: the
# tiny demo model derails most often inside long reasons that repeat the names its query then
# has to repeat again; a fixed phrase keeps the format and leaves the copying to the arguments.
BRIEF_THINK = {"image_search": "Identify the image.", "text_search": "Search for the next fact.",
               "response": "The results give the answer.", "restore": "Restore the image first.",
               "recall": "I know this one."}


# ---------------------------------------------------------------------------
# reading the conversation


@dataclass
class Step:
    """One earlier tool call of the oracle and the tool's answer."""

    name: str
    arguments: dict[str, Any]
    ok: bool
    text: str
    new_images: list[str]


def read_conversation(messages: list[dict[str, Any]]) -> tuple[str, list[str], list[Step]]:
    """(question, image names of the user turn, earlier tool steps) from format-shaped messages."""
    question, user_images, steps = None, [], []
    pending: dict[str, Any] | None = None
    for m in messages:
        role = m.get("role")
        if role == "user" and question is None:
            question, user_images = m["content"], list(m.get("images") or [])
        elif role == "assistant":
            try:
                turn = parse_turn(m["content"], _TOOL_NAMES)
            except ParseError:
                pending = None
                continue
            pending = {"name": turn.name, "arguments": turn.arguments} if turn.action == "tool_call" else None
        elif role == "tool" and pending is not None:
            text = m["content"]
            steps.append(Step(pending["name"], pending["arguments"], not text.startswith("Error ("), text,
                              list(m.get("images") or [])))
            pending = None
    if question is None:
        raise DataError("the conversation has no user turn with a question")
    return question, user_images, steps


def find_span(form: str, text: str) -> str | None:
    """The span of ``text`` that spells ``form`` (case and runs of whitespace aside), or None.

    Word boundaries on both ends, so "Iron" is not found inside "Ironbridge". The
    returned span is copied from ``text`` itself, which is what makes every name the
    oracle writes traceable to the conversation.
    """
    words = form.split()
    if not words:
        return None
    pattern = r"\s+".join(re.escape(w) for w in words)
    m = re.search(rf"(?<!\w){pattern}(?!\w)", text, flags=re.IGNORECASE)
    return m.group(0) if m else None


def _tidy(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------------
# the oracle


@dataclass
class _Hop:
    index: int  # position in the path (1..n-1)
    title: str
    relation: str
    kind: str
    key: str
    value: str


class PathOracle:
    """ChatEngine that answers one synthesized question by walking its KG path through the tools."""

    name = "path-oracle"

    def __init__(self, question: Mapping[str, Any], seed: int = 0, cfg: OracleConfig | None = None) -> None:
        path = list(question.get("path") or [])
        if len(path) < 2:
            raise DataError(f"question {question.get('id')!r}: the oracle needs a path of >= 2 entities")
        self.row = question
        self.seed = int(seed)
        self.cfg = cfg or OracleConfig()
        self.visual = path[0]
        # an asked entity ("the country of ...", kind answer) is not a hop to find: its name is read off the last
        # hop's page, as an attribute's value is
        self.hops = [_Hop(i, p["title"], p["relation"] or "", p["descriptor_kind"] or "", p["descriptor_key"] or "",
                          p["descriptor_value"] or "") for i, p in enumerate(path)
                     if i > 0 and p["descriptor_kind"] != "answer"]
        deg = question.get("degradation") or ""
        self.undo = json.loads(deg) if (question.get("degraded") and deg) else None
        self.answer_forms = [question["answer"], *(question.get("answer_aliases") or [])]
        self.answer_key = question.get("answer_key") or ""
        self.recall_re = self.cfg.recall_pattern()

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Sampling) -> str:
        return self.next_turn(messages)

    # -- helpers ------------------------------------------------------------

    def _rng(self, n_turns: int) -> np.random.Generator:
        qid = zlib.crc32(str(self.row.get("id", "")).encode())
        return np.random.default_rng([self.seed, qid, n_turns])

    def _pick(self, rng: np.random.Generator, options: list[str]) -> str:
        return options[int(rng.integers(len(options)))] if self.cfg.wording == "varied" else options[0]

    def _spaced(self, text: str) -> str:
        return " " + text if self.cfg.copy_space else text

    def _thought(self, action: str, think: str) -> str:
        """``think`` itself, or under think="brief" the fixed phrase of ``action`` (a tool name or "response";
        the restore tools share one)."""
        return think if self.cfg.think == "full" else BRIEF_THINK.get(action, BRIEF_THINK["restore"])

    def _call(self, think: str, name: str, arguments: dict[str, Any]) -> str:
        return assistant_text(self._thought(name, think), tool_call={"name": name, "arguments": arguments})

    # -- the policy ---------------------------------------------------------

    def next_turn(self, messages: list[dict[str, Any]]) -> str:
        """The next assistant turn for this conversation (pure function of it and the seed)."""
        question, user_images, steps = read_conversation(messages)
        rng = self._rng(len(steps))
        responses = [s.text for s in steps if s.ok]
        img = user_images[0] if user_images else "img_1"

        # 0. a fact the teacher remembers: answered at once, from the path (see OracleConfig.recall)
        if not steps and self._recalls(question):
            think = f"I know the {self._key(question)} of this without searching."
            return assistant_text(self._thought("recall", think), response=self._spaced(self.answer_forms[0]))

        # 1. restore a degraded image before anything else looks at it
        if self.undo is not None:
            tool = self.undo["undo_tool"]
            tries = [s for s in steps if s.name == tool]
            if not any(s.ok for s in tries) and len(tries) < 2:
                what = {"sharpen": "blurred", "super_resolution": "small and low-resolution",
                        "perspective_correct": "seen at a skewed angle"}.get(tool, "degraded")
                think = self._pick(rng, [
                    f"The image looks {what}; restore it with {tool} before searching.",
                    f"{img} is {what}. Fix that first with {tool}, then identify it.",
                    f"Before a reverse search, {tool} should undo the image being {what}.",
                ])
                return self._call(think, tool, {"image": img})

        # 2. identify the pictured entity by reverse image search
        visual = self.visual["title"]
        searches = [s for s in steps if s.name == "image_search"]
        visual_span = next((find_span(visual, s.text) for s in searches if s.ok and find_span(visual, s.text)), None)
        if visual_span is None:
            if len(searches) >= self.cfg.image_attempts:
                return self._give_up(rng, "the reverse image search did not identify the image")
            restored = [n for s in steps if s.ok and self.undo and s.name == self.undo["undo_tool"]
                        for n in s.new_images]
            target = restored[-1] if restored and not searches else img
            ref = self.visual.get("descriptor_value") or "the image"
            think = self._pick(rng, [
                f"The question starts from {ref}. Find out what {target} shows with a reverse image search.",
                f"First identify {ref}: search the web for {target}.",
                f"I need to know what {target} depicts; a reverse image search should tell.",
            ]) if not searches else f"That search did not settle it; try a reverse image search on {target}."
            return self._call(think, "image_search", {"image": target, "top_k": self.cfg.top_k})

        # 3. walk the path: each hop is done once its entity shows up in a tool response
        found = {0: visual_span}
        if self.cfg.in_order:  # one hop per search, in path order: a search resolves only the hop it was for
            nxt = iter(self.hops)
            hop = next(nxt, None)
            for s in steps:
                span = find_span(hop.title, s.text) if hop and s.ok and s.name == "text_search" else None
                if span is not None:
                    found[hop.index] = span
                    hop = next(nxt, None)
        else:
            seen = "\n".join(responses)
            for hop in self.hops:
                span = find_span(hop.title, seen)
                if span is not None:
                    found[hop.index] = span
        open_hops = [h for h in self.hops if h.index not in found]
        if open_hops:
            hop = self._choose_hop(open_hops, found, rng)
            queries = self._hop_queries(hop, question, found, rng)
            asked = {_tidy(s.arguments.get("query", "")).lower() for s in steps if s.name == "text_search"}
            fresh = [q for q in queries if q.lower() not in asked]
            tried = sum(1 for q in queries if q.lower() in asked)
            if not fresh or tried >= self.cfg.attempts_per_hop:
                return self._give_up(rng, "the search results never named the next entity on the path")
            top_k = self.cfg.top_k if tried == 0 else max(self.cfg.top_k, self.cfg.retry_top_k)
            return self._call(self._hop_think(hop, question, found, fresh[0], tried, rng), "text_search",
                              {"query": self._spaced(fresh[0]), "top_k": top_k})

        # 4. the answer: an attribute of the last entity, read off a response
        last = found[self.hops[-1].index]
        answer = self._answer_span(responses, found)
        queries = self._answer_queries(question, last, rng) if answer is None or self.cfg.look_up else []
        asked = {_tidy(s.arguments.get("query", "")).lower() for s in steps if s.name == "text_search"}
        fresh = [q for q in queries if q.lower() not in asked]
        tried = sum(1 for q in queries if q.lower() in asked)
        if answer is not None and (tried or not self.cfg.look_up):
            quoted = self._quote(responses, answer) if self.cfg.quote else None
            if quoted:  # the answer as the quote spells it: a copy of the thought's end
                think = self._thought("response", f"The results give the {self._key(question)} of {last}.")
                return assistant_text(think + self._spaced(quoted[0]), response=self._spaced(quoted[1]))
            think = self._pick(rng, [
                f"The results give the {self._key(question)} of {last}: {answer}.",
                f"{last} is the entity the question describes, and its {self._key(question)} is {answer}.",
                f"So the chain ends at {last}; the {self._key(question)} listed there is {answer}.",
            ])
            return assistant_text(self._thought("response", think), response=self._spaced(answer))
        if not fresh or tried >= self.cfg.attempts_per_hop:
            return self._give_up(rng, f"no result listed the {self._key(question)} of {last}")
        think = self._pick(rng, [
            f"The last entity is {last}. Look up its {self._key(question)}.",
            f"Now I need the {self._key(question)} of {last}.",
            f"Every hop is resolved; search for the {self._key(question)} of {last}.",
        ]) if tried == 0 else f"That did not show the {self._key(question)}; try another query."
        top_k = self.cfg.look_up_top_k if self.cfg.look_up and self.cfg.look_up_top_k and tried == 0 else self.cfg.top_k
        return self._call(think, "text_search", {"query": self._spaced(fresh[0]), "top_k": top_k})

    def _recalls(self, question: str) -> bool:
        """Whether the teacher answers this question from memory: it matches ``recall_match`` and a draw of its
        own (by question id and seed, not by turn) falls under ``recall``."""
        if self.cfg.recall <= 0 or not self.recall_re.search(question):
            return False
        qid = zlib.crc32(str(self.row.get("id", "")).encode())
        return float(np.random.default_rng([self.seed, qid, 7]).random()) < self.cfg.recall

    def _give_up(self, rng: np.random.Generator, why: str) -> str:
        return assistant_text(f"I am stuck: {why}.", response=GIVE_UP)

    def _key(self, question: str) -> str:
        """The answer key as the question spells it (it is lower-cased there)."""
        return find_span(self.answer_key, question) or "answer"

    def _choose_hop(self, open_hops: list[_Hop], found: dict[int, str], rng: np.random.Generator) -> _Hop:
        """The next hop in path order, or sometimes a later one whose descriptor stands on its own."""
        nxt = open_hops[0]
        if found.get(nxt.index - 1) is None:  # a jump happened before: go back to the first hop we can reach
            reachable = [h for h in open_hops if h.index - 1 in found]
            nxt = reachable[0] if reachable else nxt
        alone = [h for h in open_hops if h is not nxt and h.kind in ("description", "attribute")]
        if alone and rng.random() < self.cfg.reorder_prob:
            return alone[int(rng.integers(len(alone)))]
        return nxt

    def _descriptor(self, hop: _Hop, question: str) -> str | None:
        """The words of the hop's descriptor as the question spells them (None if it does not)."""
        if hop.kind == "description":
            return find_span(hop.value, question)
        if hop.kind == "attribute":
            key, value = find_span(hop.key, question), find_span(hop.value, question)
            clause = find_span(f"{hop.key} is {hop.value}", question) if self.cfg.verbatim else None
            if clause:
                return clause
            if key and value:
                return f"{key} {value}"
            return value
        if hop.kind == "category":
            return find_span(hop.value.split(".")[-1].replace("_", " "), question)
        if hop.kind == "relation":
            return find_span(hop.key, question)
        return None

    def _hop_queries(self, hop: _Hop, question: str, found: dict[int, str], rng: np.random.Generator) -> list[str]:
        """Candidate queries for one hop, best first; every word comes from the question or a response.

        Order (measured on the sample, docs/measurements.md): a description or an attribute
        usually finds its entity on its own; the previous entity's name helps typed relations
        and categories (categories are not in the index, so only the article text can
        connect them).
        """
        desc = self._descriptor(hop, question)
        prev = found.get(hop.index - 1)
        rel = find_span(hop.relation, question) if hop.relation and hop.relation != "linked_to" else None
        value = find_span(hop.value, question) if hop.kind == "attribute" else None
        out: list[str] = []
        if prev and rel:
            out.append(self._pick(rng, [f"{prev} {rel}", f"{rel} of {prev}"]))
        if desc and hop.kind in ("description", "attribute"):
            out.append(desc)
        if prev and desc:
            out.append(self._pick(rng, [f"{desc} {prev}", f"{prev} {desc}"]))
        if value and value != desc:
            out.append(value)
        if prev:
            out.append(prev)
        elif desc and hop.kind not in ("description", "attribute"):
            out.append(desc)
        # vary which wording goes first where two are about as good
        if self.cfg.wording == "varied" and len(out) > 2 and rng.random() < 0.3:
            out[0], out[1] = out[1], out[0]
        seen: list[str] = []
        for q in out:
            q = _tidy(q)
            if q and q.lower() not in {s.lower() for s in seen}:
                seen.append(q)
        return seen

    def _hop_think(self, hop: _Hop, question: str, found: dict[int, str], query: str, tried: int,
                   rng: np.random.Generator) -> str:
        prev = found.get(hop.index - 1)
        last_found = found[max(found)]
        if tried:
            return self._pick(rng, [f"Not there yet; search for {query} instead and read more results.",
                                    f"The results miss it. Rephrase the search: {query}, and look further down."])
        if prev and hop.index - 1 == max(found):
            lead = self._pick(rng, [f"That identifies {prev}.", f"So it is {prev}.", f"The match is {prev}."])
        else:
            lead = self._pick(rng, [f"So far I have {last_found}.", "One part of the chain is known."])
        desc = self._descriptor(hop, question)
        what = f"the entity the question describes as {desc}" if desc else "the next entity in the question"
        return f"{lead} Next I need {what}; search for {query}."

    def _answer_queries(self, question: str, last: str, rng: np.random.Generator) -> list[str]:
        """The answer is in the last entity's infobox passage: name the entity, the key, and (best) the
        last hop's own attribute, which sits in that same passage (it shows more answers:
        docs/measurements.md). Under ``look_up`` the first query is the key and the last hop's descriptor
        as the question spells them: two copies of the question, no name from a response."""
        key = find_span(self.answer_key, question)
        if not key:
            return [last]
        hop = self.hops[-1]
        desc = self._descriptor(hop, question)
        out: list[str] = [f"{key} {desc}"] if self.cfg.look_up and desc else []
        if desc and hop.kind == "attribute":
            out.append(f"{last} {key} {desc}")
        out.append(self._pick(rng, [f"{last} {key}", f"{key} of {last}"]))
        out.append(f"{key} {last}" if out[-1].startswith(last) else f"{last} {key}")
        return out

    def _quote(self, responses: list[str], answer: str) -> tuple[str, str] | None:
        """The latest "Key: answer" line of the responses whose key is the question's answer key, and the
        answer as that line spells it (case may differ from ``answer``'s occurrence), or None."""
        if not self.answer_key:
            return None
        for text in reversed(responses):
            line = find_span(f"{self.answer_key}: {answer}", text)
            if line:
                return line, line.split(":", len(self.answer_key.split(":")))[-1].lstrip()
        return None

    def _answer_span(self, responses: list[str], found: dict[int, str]) -> str | None:
        """The answer as a response spells it, looked for only once the last hop is resolved."""
        for text in reversed(responses):
            for form in self.answer_forms:
                span = find_span(form, text) if form else None
                if span:
                    return span
        return None
