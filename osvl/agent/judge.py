"""Answer judging: the rule-based r_acc used for rewards, eval and trajectory filtering.

r_acc = 1 when the SQuAD-normalised response equals the answer or one of its
aliases, or reaches token F1 >= 0.8 against one of them; else 0. SQuAD's
normalisation (lower case, drop punctuation and the articles a/an/the, collapse
whitespace) is the standard for short factoid answers; we add Unicode accent
folding because KG answers are full of names ("São Paulo" vs "Sao Paulo") that a
model may write either way, and score scripts written without spaces (Chinese, Japanese,
Thai, Korean) per character. The F1 threshold accepts one extra word beside a
two-word gold ("Robert Fico Slovakia" for "Robert Fico": F1 0.8) and rejects a
different name that shares a token ("Robert Kaliňák": F1 0.5). The LLM judge
(``LLMJudge``: OpenAI-compatible, "correct: yes/no") is a separate, optional path
with retries, a cache and an explicit failure policy.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from osvl.agent.engines.base import Sampling
from osvl.errors import EndpointUnavailable

F1_THRESHOLD = 0.8

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | {"’", "‘", "“", "”", "…"}
_DASHES = str.maketrans({"–": " ", "—": " "})  # dashes separate words; SQuAD's deletion would glue them


def normalize_answer(text: str) -> str:
    """SQuAD normalisation plus accent folding."""
    text = unicodedata.normalize("NFKD", text.translate(_DASHES))
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


# scripts written without spaces between words: each character is a token (the usual rule for
# Chinese/Japanese/Thai QA metrics), so "阿灵顿排屋" against "阿灵顿排屋（Arlington Row）" is scored
# per character instead of as one unbreakable word
_PER_CHAR = re.compile(r"([\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af])")


def answer_tokens(text: str) -> list[str]:
    """The normalised answer's tokens: words, and single characters of scripts without spaces."""
    return [t for word in normalize_answer(text).split() for t in _PER_CHAR.split(word) if t]


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two (unnormalised) strings (``answer_tokens``)."""
    pred, ref = answer_tokens(prediction), answer_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_reward(response: str | None, answer: str, aliases: Iterable[str] = ()) -> float:
    """r_acc in {0, 1}: exact match after normalisation, or token F1 >= 0.8, against any gold form."""
    if response is None:
        return 0.0
    golds = [g for g in (answer, *aliases) if g and normalize_answer(g)]
    tokens = answer_tokens(response)
    if not tokens:
        return 0.0
    for gold in golds:
        if tokens == answer_tokens(gold) or token_f1(response, gold) >= F1_THRESHOLD:
            return 1.0
    return 0.0


# ---------------------------------------------------------------------------
# LLM answer judge: "correct: yes/no" over an OpenAI-compatible endpoint

JUDGE_PROMPT = (
    "You grade answers to factual questions. Decide whether the candidate answer means the same as the "
    "reference answer (or one of its aliases): the same entity, number or date, however it is worded. Extra "
    "explanation around a correct answer is fine; a different or hedged answer is not.\n\n"
    "Question: {question}\nReference answer: {answer}\nAliases: {aliases}\nCandidate answer: {response}\n\n"
    "Reply with exactly one line: \"correct: yes\" or \"correct: no\"."
)
_VERDICT = re.compile(r"correct\s*:\s*(yes|no)\b", re.IGNORECASE)


def parse_verdict(reply: str) -> bool | None:
    """True/False from a "correct: yes/no" reply (the last verdict line wins); None if there is none."""
    found = _VERDICT.findall(reply or "")
    return found[-1].lower() == "yes" if found else None


class LLMJudge:
    """r_acc by an LLM: "correct: yes/no", retried, cached, and never a silent 0.

    Failure policy: an endpoint that stays unreachable after the engine's retries, or that
    keeps answering without a verdict (``verdict_retries`` asks), raises
    ``EndpointUnavailable``; ``osvl.agent.reward.score_trajectory`` turns that into
    ``judge_status="failed"`` on the sample, and ``mark_failed_groups`` spreads it to the
    sample's group, so GRPO never normalises a group around a made-up zero.

    Cache: verdicts are keyed by (model, question, answer, aliases, normalised response) in
    memory and, with ``cache_path``, in a JSONL file that later runs reload: a rerun of a job
    (or the G samples of a group that give the same answer) asks the endpoint once.
    Temperature 0, so a cached verdict is the one the endpoint would give again.
    """

    def __init__(self, engine: Any, cache_path: str | None = None, verdict_retries: int = 2) -> None:
        self.engine = engine
        self.verdict_retries = verdict_retries
        self.cache: dict[str, bool] = {}
        self.cache_path = Path(cache_path) if cache_path else None
        self.stats = {"asked": 0, "cache_hits": 0, "no_verdict": 0}
        if self.cache_path and self.cache_path.is_file():
            for line in self.cache_path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.cache[row["key"]] = bool(row["correct"])

    def _key(self, question: str, answer: str, aliases: Iterable[str], response: str) -> str:
        blob = json.dumps([getattr(self.engine, "name", ""), question, answer, sorted(aliases),
                           normalize_answer(response)], ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def judge(self, question: str, answer: str, aliases: Iterable[str], response: str) -> float:
        """1.0 or 0.0; raises ``EndpointUnavailable`` when no verdict can be had (see the class doc)."""
        aliases = list(aliases)
        key = self._key(question, answer, aliases, response)
        if key in self.cache:
            self.stats["cache_hits"] += 1
            return float(self.cache[key])
        prompt = JUDGE_PROMPT.format(question=question, answer=answer, aliases=", ".join(aliases) or "none",
                                     response=response)
        verdict = None
        for _ in range(self.verdict_retries + 1):
            self.stats["asked"] += 1
            reply = await self.engine.complete([{"role": "user", "content": prompt}],
                                               Sampling(temperature=0.0, max_new_tokens=16))
            verdict = parse_verdict(reply)
            if verdict is not None:
                break
            self.stats["no_verdict"] += 1
        if verdict is None:
            raise EndpointUnavailable(f"judge {getattr(self.engine, 'name', '')}: no 'correct: yes/no' verdict "
                                      f"in {self.verdict_retries + 1} replies")
        self.cache[key] = verdict
        if self.cache_path:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with self.cache_path.open("a") as f:
                f.write(json.dumps({"key": key, "correct": verdict}) + "\n")
        return float(verdict)
