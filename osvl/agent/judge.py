"""Answer judging: the rule-based r_acc used for rewards, eval and trajectory filtering.

r_acc = 1 when the SQuAD-normalised response equals the answer or one of its
aliases, or reaches token F1 >= 0.8 against one of them; else 0. SQuAD's
normalisation (lower case, drop punctuation and the articles a/an/the, collapse
whitespace) is the standard for short factoid answers; we add Unicode accent
folding because KG answers are full of names ("São Paulo" vs "Sao Paulo") that a
model may write either way. The F1 threshold accepts one extra word beside a
two-word gold ("Robert Fico Slovakia" for "Robert Fico": F1 0.8) and rejects a
different name that shares a token ("Robert Kaliňák": F1 0.5). The LLM judge
(OpenAI-compatible, "correct: yes/no") is a separate, optional path.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable

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


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two (unnormalised) strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
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
    norm = normalize_answer(response)
    if not norm:
        return 0.0
    for gold in golds:
        if norm == normalize_answer(gold) or token_f1(response, gold) >= F1_THRESHOLD:
            return 1.0
    return 0.0
