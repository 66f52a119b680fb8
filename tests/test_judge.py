"""Rule-based r_acc: SQuAD normalisation, token F1, the 0.8 threshold, aliases (hand-computed values)."""

from __future__ import annotations

import pytest

from osvl.agent.judge import answer_reward, normalize_answer, token_f1


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("São Paulo", "sao paulo"),
    ("  A  b  ", "b"),
    ("Mustelidae.", "mustelidae"),
    ("4,000 m³/s", "4000 m3s"),
    ("an apple—the end", "apple end"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("1832", "1832", 1.0),
    ("Robert Fico Slovakia", "Robert Fico", 0.8),
    ("Robert Fico, prime minister", "Robert Fico", 2 / 3),
    ("Robert Kaliňák", "Robert Fico", 0.5),
    ("", "", 1.0),
    ("the", "Paris", 0.0),
    ("Lyon", "Paris", 0.0),
])
def test_token_f1(pred, gold, expected):
    assert token_f1(pred, gold) == pytest.approx(expected)


@pytest.mark.parametrize("response, answer, aliases, expected", [
    ("Sao Paulo", "São Paulo", [], 1.0),
    ("The Colosseum", "Colosseum", [], 1.0),
    ("Paris", "Lyon", ["Paris"], 1.0),               # an alias counts
    ("Robert Fico Slovakia", "Robert Fico", [], 1.0),  # F1 exactly at the threshold
    ("Robert Fico, prime minister", "Robert Fico", [], 0.0),
    ("Robert Kaliňák", "Robert Fico", [], 0.0),
    (None, "Paris", [], 0.0),                        # no response at all
    ("", "Paris", [], 0.0),
    ("the", "Paris", [""], 0.0),                     # normalises to nothing; empty alias ignored
])
def test_answer_reward(response, answer, aliases, expected):
    assert answer_reward(response, answer, aliases) == expected
