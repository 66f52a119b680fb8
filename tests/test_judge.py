"""Rule-based r_acc: SQuAD normalisation, token F1, the 0.8 threshold, aliases (hand-computed values)."""

from __future__ import annotations

import pytest
from _recording import RecordingEngine

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


# ---------------------------------------------------------------------------
# LLMJudge against an in-process engine that records what it is asked (tests/test_reward.py drives it over HTTP)


def _judge(judge, *args):
    import asyncio

    return asyncio.run(judge.judge(*args))


def test_llm_judge_prompt_sampling_and_counts():
    from osvl.agent.judge import LLMJudge

    engine = RecordingEngine(["correct: yes"])
    judge = LLMJudge(engine)
    assert judge.stats == {"asked": 0, "cache_hits": 0, "no_verdict": 0}
    assert _judge(judge, "Where is the tower?", "Paris", ["City of Light", "Lutetia"], "in paris") == 1.0
    (messages, sampling), = engine.calls  # a verdict on the first reply: asked once
    assert [m["role"] for m in messages] == ["user"]
    prompt = messages[0]["content"]
    for line in ("Question: Where is the tower?", "Reference answer: Paris", "Aliases: City of Light, Lutetia",
                 "Candidate answer: in paris", 'Reply with exactly one line: "correct: yes" or "correct: no".'):
        assert line in prompt.splitlines()
    assert (sampling.temperature, sampling.max_new_tokens) == (0.0, 16)
    assert judge.stats == {"asked": 1, "cache_hits": 0, "no_verdict": 0}
    engine.replies = ["correct: no"]
    assert _judge(judge, "Where is the tower?", "Paris", [], "Lyon") == 0.0
    assert "Aliases: none" in engine.calls[-1][0][0]["content"].splitlines()


def test_llm_judge_cache_key_and_hits(tmp_path):
    from osvl.agent.judge import LLMJudge

    engine = RecordingEngine(["correct: yes"] * 8)
    judge = LLMJudge(engine, cache_path=str(tmp_path / "deep" / "er" / "judge.jsonl"))  # parents are made
    assert _judge(judge, "Q1", "Paris", ["Lutetia"], "Paris") == 1.0
    assert _judge(judge, "Q1", "Paris", ["Lutetia"], "paris!") == 1.0  # same normalised response
    assert _judge(judge, "Q1", "Paris", ["Lutetia"], "the Paris") == 1.0
    assert len(engine.calls) == 1 and judge.stats["cache_hits"] == 2
    # a different question, answer or alias list is a different verdict
    for args in (("Q2", "Paris", ["Lutetia"], "Paris"), ("Q1", "Lyon", ["Lutetia"], "Paris"),
                 ("Q1", "Paris", [], "Paris")):
        _judge(judge, *args)
    assert len(engine.calls) == 4 and judge.stats["cache_hits"] == 2
    # another judge model does not reuse these verdicts, the same model in a new process does
    other = LLMJudge(RecordingEngine(["correct: no"], name="judge-b"), cache_path=str(judge.cache_path))
    assert _judge(other, "Q1", "Paris", ["Lutetia"], "Paris") == 0.0 and other.stats["asked"] == 1
    again = LLMJudge(RecordingEngine([]), cache_path=str(judge.cache_path))
    assert _judge(again, "Q1", "Paris", ["Lutetia"], "Paris") == 1.0 and again.stats["cache_hits"] == 1


def test_llm_judge_reads_a_cache_written_by_the_documented_key(tmp_path):
    """Verdict files outlive runs: the key is sha256 of the JSON list [model name or "", question, answer,
    sorted aliases, normalised response], non-ASCII kept as is."""
    import hashlib
    import json

    from osvl.agent.judge import LLMJudge

    blob = json.dumps(["", "Où est né Pelé ?", "Três Corações", ["Ab", "Tres Coracoes"], "tres coracoes"],
                      ensure_ascii=False)
    line = {"key": hashlib.sha256(blob.encode()).hexdigest(), "correct": True}
    path = tmp_path / "judge.jsonl"
    path.write_text(json.dumps(line) + "\n\n")
    engine = RecordingEngine([], name=None)  # an engine without a name
    judge = LLMJudge(engine, cache_path=str(path))
    assert _judge(judge, "Où est né Pelé ?", "Três Corações", ["Tres Coracoes", "Ab"], "Três Corações!") == 1.0
    assert engine.calls == [] and judge.stats["cache_hits"] == 1


def test_llm_judge_retries_then_fails_loudly():
    from osvl.agent.judge import LLMJudge
    from osvl.errors import EndpointUnavailable

    engine = RecordingEngine(["hmm", "", "correct: no"])
    judge = LLMJudge(engine)  # two retries by default: three asks
    assert _judge(judge, "Q", "Paris", [], "Lyon") == 0.0
    assert judge.stats == {"asked": 3, "cache_hits": 0, "no_verdict": 2}
    engine = RecordingEngine([])
    with pytest.raises(EndpointUnavailable, match="in 3 replies"):
        _judge(LLMJudge(engine), "Q", "Paris", [], "Lyon")
    assert len(engine.calls) == 3
    engine = RecordingEngine(["hmm"] * 10)
    judge = LLMJudge(engine, verdict_retries=1)
    with pytest.raises(EndpointUnavailable, match=r"^judge judge-a: no 'correct: yes/no' verdict in 2 replies$"):
        _judge(judge, "Q", "Paris", [], "Lyon")
    assert len(engine.calls) == 2 and judge.stats["no_verdict"] == 2 and judge.cache == {}
    with pytest.raises(EndpointUnavailable, match=r"^judge : no"):
        _judge(LLMJudge(RecordingEngine([], name=None), verdict_retries=0), "Q", "Paris", [], "Lyon")
