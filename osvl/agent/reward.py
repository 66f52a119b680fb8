"""Scoring a trajectory: r_fmt, r_acc, r_query and the reward of docs/design.md.

    reward = r_fmt * (alpha * r_acc + (1 - alpha) * r_query),   alpha = 0.8

- **r_fmt**: share of the pre-fatal assistant turns that are well-formed, or with
  ``fmt_scope="episode"`` share of *all* the episode's assistant turns, the fatal cascade included.
  Why the option: on the prefix, [ok, bad, bad, bad] (fatal at once) scores r_fmt 1.0 while a
  non-fatal [ok, bad, ok, bad, ok, wrong answer] scores 0.67, so a policy that does not yet answer
  correctly (r_acc 0 everywhere) is paid for dying early, and the clamp never pushes a fatal
  trajectory down. Counting the cascade ranks the early death below any attempt that keeps
  parsing (the demo's runs with each setting: docs/measurements.md). Well-formed: the turn parses
  (``action != "invalid"``) and, with ``fmt_args`` (default, the paper's text, which scores a step with
  malformed arguments 0 as well), it is not a tool call the tool refused as ``invalid_call`` (wrong or
  missing arguments, an unknown tool). ``fmt_args=False`` counts parse failures only (osvl's earlier rule).
- **r_acc**: 0 for a fatal trajectory or one without a response; else the rule judge
  (``judge.answer_reward``), or the LLM judge (``judge.LLMJudge``), or the rule first and
  the LLM only where the rule says no (``judge="rule_then_llm"``: the rule's yes is cheap
  and reliable, its no is where paraphrases get lost).
- **r_query** in [0, 1], rule-based by default, on the pre-fatal prefix:

      r_query = 0.5 * mean_j(grounded_j * fresh_j) + 0.5 * progress

  over the prefix's ``text_search`` queries q_j. ``grounded_j`` = 1 when q_j names a
  path entity, or when at least half of its content words (lower-cased alphanumeric
  tokens, stop words dropped) occur in the question or in an earlier tool response:
  queries built on what the agent was told or has found, not on guesses. ``fresh_j`` = 0
  when q_j repeats an earlier query (after whitespace and case folding): repeats waste a
  turn. ``progress`` = share of the question's path entities (the pictured one included)
  that appear in the prefix's successful tool responses: how far along the hops the
  search got. Without a path (imported questions) progress is dropped and
  r_query = mean_j(grounded_j * fresh_j). No query at all: r_query = 0.5 * progress.
- An LLM process judge (``ProcessJudge``) may replace the rule: it reads the question and
  the prefix's tool calls and answers "score: N" with N in 0..10.

Judge failures are explicit: ``score_trajectory`` sets ``judge_status="failed"`` (r_acc and
reward 0 but *marked*), and ``mark_failed_groups`` spreads the mark to every trajectory of
the failed sample's group, which GRPO must then skip (never normalise around a made-up 0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from osvl.agent.engines.base import Sampling
from osvl.agent.fatal import MaskStart, mask_start
from osvl.agent.judge import answer_reward
from osvl.agent.trajectory import Trajectory, Turn
from osvl.config import opt
from osvl.errors import ConfigError, EndpointUnavailable

Judge = Literal["rule", "llm", "rule_then_llm"]
QueryScorer = Literal["rule", "llm"]
FmtScope = Literal["prefix", "episode"]
JUDGES = get_args(Judge)
QUERY_SCORERS = get_args(QueryScorer)

_STOP = frozenset(
    "a an the of in on at to for from by with and or is are was were be been it its this that these those what "
    "which who whom whose where when how one ones as into about than then there their mentioned article".split())
_WORD = re.compile(r"\w+")


@dataclass
class RewardConfig:
    alpha: float = opt(0.8, "Weight of r_acc against r_query inside the format gate.")
    judge: Judge = opt("rule", "Answer judge (see the module docstring).")
    query_scorer: QueryScorer = opt("rule", "r_query: the rule, or llm (the process judge).")
    prefix_end: MaskStart = opt("cascade", "Where the pre-fatal prefix ends: 'cascade' (first failure of the "
                                           "fatal run: the paper's text and released code) or 'kth' (the K-th "
                                           "failure).")
    fmt_args: bool = opt(True, "r_fmt also scores 0 a parsed tool call the tool refuses as invalid_call (malformed "
                               "arguments; the paper's text); False: parse failures only.")
    fmt_scope: FmtScope = opt("prefix", "r_fmt over the pre-fatal 'prefix' (docs/design.md) or the whole "
                                        "'episode', the fatal cascade's unparsable turns counted (see the module "
                                        "docstring).")

    def check(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.judge not in JUDGES or self.query_scorer not in QUERY_SCORERS:
            raise ConfigError(f"judge must be one of {JUDGES} and query_scorer one of {QUERY_SCORERS}")
        if self.fmt_scope not in ("prefix", "episode"):
            raise ConfigError(f"fmt_scope must be 'prefix' or 'episode', got {self.fmt_scope!r}")

    def uses_llm(self) -> bool:
        """Whether scoring asks an LLM judge (r_acc past the rule, or r_query), so a judge endpoint is needed."""
        return self.judge != "rule" or self.query_scorer == "llm"


def prefix_turns(traj: Trajectory, prefix_end: MaskStart = "cascade") -> list[Turn]:
    """The assistant turns before the mask start (all of them when the trajectory is not fatal)."""
    end = mask_start(traj.fatal_cascade_start, traj.fatal_kth, prefix_end)
    return [t for t in traj.turns if t.index < end]


def well_formed(turn: Turn, args: bool = True) -> bool:
    """What r_fmt counts: a turn that parses and, with ``args``, whose tool did not refuse its arguments."""
    if turn.action == "invalid":
        return False
    return not (args and turn.action == "tool_call" and turn.error_kind == "invalid_call")


def content_words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


def _names(text: str, title: str) -> bool:
    """``title`` occurs in ``text`` as whole words, case and whitespace aside."""
    words = title.split()
    if not words:
        return False
    pattern = r"\s+".join(re.escape(w) for w in words)
    return re.search(rf"(?<!\w){pattern}(?!\w)", text, flags=re.IGNORECASE) is not None


def path_titles(question: Mapping[str, Any]) -> list[str]:
    return [str(p["title"]) for p in (question.get("path") or []) if p.get("title")]


def rule_query_score(turns: Iterable[Turn], question: Mapping[str, Any]) -> float:
    """The documented rule-based r_query (module docstring) of a trajectory prefix."""
    titles = path_titles(question)
    known = set(content_words(str(question.get("question", ""))))
    asked: set[str] = set()
    parts: list[float] = []
    seen_text: list[str] = []
    for t in turns:
        if t.action == "tool_call" and t.tool == "text_search" and isinstance(t.arguments, dict):
            query = str(t.arguments.get("query", ""))
            norm = " ".join(query.lower().split())
            words = content_words(query)
            grounded = any(_names(query, title) for title in titles) or (
                bool(words) and sum(w in known for w in words) * 2 >= len(words))
            parts.append(float(grounded and norm not in asked))
            asked.add(norm)
        if t.status == "ok" and t.observation:
            known.update(content_words(t.observation))
            seen_text.append(t.observation)
    if not titles:
        return sum(parts) / len(parts) if parts else 0.0
    blob = "\n".join(seen_text)
    progress = sum(_names(blob, title) for title in titles) / len(titles)
    quality = sum(parts) / len(parts) if parts else 0.0
    return 0.5 * quality + 0.5 * progress


# ---------------------------------------------------------------------------
# LLM process judge

PROCESS_PROMPT = (
    "You grade how well a search agent searched, not whether its final answer is right. Good searching: each "
    "query names entities from the question or from earlier results, no query repeats an earlier one, and the "
    "searches move along the chain of entities the question describes.\n\n"
    "Question: {question}\n\nThe agent's tool calls and what they returned:\n{steps}\n\n"
    "Reply with exactly one line: \"score: N\" with N an integer from 0 (useless) to 10 (ideal)."
)
_SCORE = re.compile(r"score\s*:\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


class ProcessJudge:
    """r_query by an LLM over an OpenAI-compatible engine ("score: N", N in 0..10, divided by 10).

    Same failure policy as ``LLMJudge``: no verdict after the retries raises
    ``EndpointUnavailable``, which the scorer turns into a marked sample.
    """

    def __init__(self, engine: Any, verdict_retries: int = 2, observation_chars: int = 400) -> None:
        self.engine = engine
        self.verdict_retries = verdict_retries
        self.observation_chars = observation_chars

    async def score(self, turns: list[Turn], question: Mapping[str, Any]) -> float:
        lines = []
        for t in turns:
            if t.action == "tool_call":
                obs = t.observation[: self.observation_chars]
                lines.append(f"- {t.tool}({t.arguments}) -> {obs}")
        prompt = PROCESS_PROMPT.format(question=question.get("question", ""), steps="\n".join(lines) or "(none)")
        for _ in range(self.verdict_retries + 1):
            reply = await self.engine.complete([{"role": "user", "content": prompt}],
                                               Sampling(temperature=0.0, max_new_tokens=16))
            found = _SCORE.findall(reply or "")
            if found:
                return min(max(float(found[-1]) / 10.0, 0.0), 1.0)
        raise EndpointUnavailable(f"process judge {getattr(self.engine, 'name', '')}: no 'score: N' verdict")


# ---------------------------------------------------------------------------


async def score_trajectory(traj: Trajectory, question: Mapping[str, Any], cfg: RewardConfig, *,
                           llm_judge: Any = None, process_judge: Any = None) -> Trajectory:
    """Fill r_fmt, r_acc, r_query, reward and judge_status of ``traj`` (in place; also returned)."""
    cfg.check()
    if cfg.judge != "rule" and llm_judge is None:
        raise ConfigError(f"judge={cfg.judge!r} needs an llm_judge")
    if cfg.query_scorer == "llm" and process_judge is None:
        raise ConfigError("query_scorer='llm' needs a process_judge")
    prefix = prefix_turns(traj, cfg.prefix_end)
    scored = prefix if cfg.fmt_scope == "prefix" else list(traj.turns)
    traj.r_fmt = sum(well_formed(t, cfg.fmt_args) for t in scored) / len(scored) if scored else 0.0
    traj.judge_status = "ok"
    answer = str(question.get("answer", traj.answer))
    aliases = list(question.get("answer_aliases") or traj.answer_aliases)
    try:
        if traj.fatal or traj.final_answer is None or traj.stop_reason != "response":
            traj.r_acc = 0.0
        else:
            traj.r_acc = answer_reward(traj.final_answer, answer, aliases) if cfg.judge != "llm" else 0.0
            if cfg.judge != "rule" and traj.r_acc == 0.0:
                traj.r_acc = await llm_judge.judge(traj.question, answer, aliases, traj.final_answer)
        if cfg.query_scorer == "llm":
            traj.r_query = await process_judge.score(prefix, question)
        else:
            traj.r_query = rule_query_score(prefix, question)
    except EndpointUnavailable as e:
        traj.judge_status = "failed"
        traj.r_acc, traj.reward = 0.0, 0.0
        traj.events = [*traj.events, f"judge_failed:{str(e)[:200]}"]
        return traj
    traj.reward = traj.r_fmt * (cfg.alpha * traj.r_acc + (1 - cfg.alpha) * traj.r_query)
    return traj


def mark_failed_groups(trajs: list[Trajectory]) -> int:
    """Mark every trajectory whose group holds a judge failure; returns how many were newly marked."""
    failed = {t.group_id for t in trajs if t.judge_status == "failed"}
    newly = 0
    for t in trajs:
        if t.group_id in failed and t.judge_status != "failed":
            t.judge_status = "failed"
            t.events = [*t.events, "judge_failed:group"]
            newly += 1
    return newly
