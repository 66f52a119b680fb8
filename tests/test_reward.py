"""Rewards and judges: the rule r_query formula, score_trajectory, and the LLM judges over real HTTP.

The LLM-judge tests talk to a real aiohttp server on 127.0.0.1 that speaks the OpenAI
chat-completions protocol. It is a *test server*, not a model: it answers by a fixed,
documented rule (``correct: yes`` when the candidate answer in the prompt contains the
reference answer, ``score: 7`` for process prompts), and it can be told to fail its next
requests with HTTP 503 or to reply without a verdict.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re

import numpy as np
import pytest
from _recording import RecordingEngine

from osvl.agent.engines.base import Sampling
from osvl.agent.engines.openai import OpenAIChatEngine
from osvl.agent.judge import LLMJudge, parse_verdict
from osvl.agent.reward import (
    ProcessJudge,
    RewardConfig,
    mark_failed_groups,
    prefix_turns,
    rule_query_score,
    score_trajectory,
)
from osvl.agent.trajectory import Trajectory, Turn
from osvl.cluster import free_port
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError, EndpointUnavailable

QUESTION = {"id": "q1", "question": "What is the capital of the country that the bridge in the image is in?",
            "answer": "London", "answer_aliases": ["City of London"],
            "path": [{"title": "Tower Bridge"}, {"title": "England"}]}


def turn(i, tool=None, args=None, obs="", status="ok", action=None, failed=False):
    return Turn(index=i, text="", action=action or ("tool_call" if tool else "response"), tool=tool,
                arguments=args, status=status if tool else "", failed=failed, observation=obs)


def traj(turns, final="London", stop="response", fatal=(-1, -1), group="g"):
    return Trajectory(id=f"t{len(turns)}{final}", question_id="q1", group_id=group, kind="teacher",
                      question=QUESTION["question"], answer="London", answer_aliases=["City of London"],
                      input_ids=[], gen_mask=[], logprobs=[], step_ids=[], images=[], image_max_pixels=[],
                      processor={}, turns=turns, fatal_cascade_start=fatal[0], fatal_kth=fatal[1], stop_reason=stop,
                      final_answer=final)


GOOD = [turn(0, "image_search", {"image": "img_1"}, "1. Tower Bridge — Bridge over the Thames"),
        turn(1, "text_search", {"query": "Tower Bridge country"}, "1. England\n   Country; capital London."),
        turn(2)]


def test_rule_query_score_formula():
    # one grounded fresh query; both path entities appear in responses -> 0.5 * 1 + 0.5 * 1
    assert rule_query_score(GOOD, QUESTION) == 1.0
    # a repeated query counts 0, an ungrounded one ("zebra") 0: quality (1 + 0 + 0) / 3; progress 2/2
    turns = GOOD[:2] + [turn(2, "text_search", {"query": "tower bridge  COUNTRY"}, "1. England"),
                        turn(3, "text_search", {"query": "zebra stripes"}, "No results")]
    assert rule_query_score(turns, QUESTION) == pytest.approx(0.5 * 1 / 3 + 0.5)
    # no query, only the image search found the first entity: 0.5 * progress = 0.5 * 1/2
    assert rule_query_score(GOOD[:1], QUESTION) == pytest.approx(0.25)
    # a failed call's text is not progress
    failed = [turn(0, "image_search", {"image": "img_1"}, "Error (timeout): slow", status="error")]
    assert rule_query_score(failed, QUESTION) == 0.0
    # without a path: the mean of grounded * fresh (half the query's words from the question)
    assert rule_query_score(GOOD, {"question": QUESTION["question"]}) == 1.0


def test_score_trajectory_rewards_and_fatal_prefix():
    cfg = RewardConfig()
    t = asyncio.run(score_trajectory(traj(list(GOOD)), QUESTION, cfg))
    assert (t.r_fmt, t.r_acc, t.r_query, t.reward, t.judge_status) == (1.0, 1.0, 1.0, 1.0, "ok")
    # alias counts; one invalid turn of 4 -> r_fmt 0.75
    bad = [*GOOD[:2], turn(2, action="invalid"), turn(3)]
    t = asyncio.run(score_trajectory(traj(bad, final="city of london"), QUESTION, cfg))
    assert t.r_fmt == 0.75 and t.r_acc == 1.0 and t.reward == pytest.approx(0.75 * (0.8 + 0.2 * 1.0))
    # fatal: r_acc 0; r_fmt and r_query on the prefix before the cascade start (turn 1)
    fail = [turn(i, "text_search", {"query": "x"}, "Error (timeout): t", status="error", failed=True)
            for i in range(1, 4)]
    t = asyncio.run(score_trajectory(traj([GOOD[0], *fail], final=None, stop="fatal", fatal=(1, 3)), QUESTION, cfg))
    assert t.r_acc == 0.0 and t.r_fmt == 1.0 and t.r_query == pytest.approx(0.25)
    assert t.reward == pytest.approx(0.2 * 0.25)
    # kth: the prefix runs to the K-th failure, so the failed (valid) calls count too
    t = asyncio.run(score_trajectory(traj([GOOD[0], *fail], final=None, stop="fatal", fatal=(1, 3)), QUESTION,
                                     RewardConfig(prefix_end="kth")))
    assert t.r_query == pytest.approx(0.5 * 0.0 + 0.25)
    # a fatal episode that went on (stop_on_fatal off) and answered right still gets r_acc 0
    t = asyncio.run(score_trajectory(traj([GOOD[0], *fail, turn(4)], fatal=(1, 3)), QUESTION, cfg))
    assert t.r_acc == 0.0 and t.reward == pytest.approx(0.2 * 0.25)
    with pytest.raises(ConfigError, match="mask start"):
        asyncio.run(score_trajectory(traj(list(GOOD)), QUESTION, RewardConfig(prefix_end="last")))
    # fmt_scope="episode": an unparsable cascade right after a good first turn no longer scores r_fmt 1.0
    # (the prefix rule pays a policy that cannot answer yet for dying early), and it ranks below a
    # non-fatal episode that keeps parsing between its mistakes
    junk = [turn(i, action="invalid", failed=True) for i in range(1, 4)]
    early = traj([GOOD[0], *junk], final=None, stop="fatal", fatal=(1, 3))
    assert asyncio.run(score_trajectory(early, QUESTION, cfg)).r_fmt == 1.0
    episode = RewardConfig(fmt_scope="episode")
    early = asyncio.run(score_trajectory(early, QUESTION, episode))
    assert early.r_fmt == 0.25 and early.r_query == pytest.approx(0.25)
    mixed = [GOOD[0], turn(1, action="invalid", failed=True), GOOD[1], turn(3, action="invalid", failed=True),
             turn(4)]
    late = asyncio.run(score_trajectory(traj(mixed, final="Paris"), QUESTION, episode))
    assert late.r_fmt == pytest.approx(3 / 5) and late.reward > early.reward
    with pytest.raises(ConfigError):
        RewardConfig(fmt_scope="all").check()
    # a call that parses but whose arguments the tool refuses (invalid_call) is malformed for r_fmt (the paper's
    # text), unless fmt_args is off; a tool's own failure (timeout) is not the format's fault
    refused = turn(1, "crop", {"image": "img_1", "box": "wide"}, "Error (invalid_call): box", status="error")
    refused.error_kind = "invalid_call"
    slow = turn(2, "text_search", {"query": "Tower Bridge"}, "Error (timeout): slow", status="error")
    slow.error_kind = "timeout"
    args = [GOOD[0], refused, slow, turn(3)]
    assert asyncio.run(score_trajectory(traj(args), QUESTION, cfg)).r_fmt == 0.75
    assert asyncio.run(score_trajectory(traj(args), QUESTION, RewardConfig(fmt_args=False))).r_fmt == 1.0
    # a wrong answer and a turn limit without an answer
    assert asyncio.run(score_trajectory(traj(list(GOOD), final="Paris"), QUESTION, cfg)).r_acc == 0.0
    assert asyncio.run(score_trajectory(traj(GOOD[:2], final=None, stop="max_turns"), QUESTION, cfg)).r_acc == 0.0


# ---------------------------------------------------------------------------
# the test server


class JudgeServer:
    """OpenAI chat-completions over aiohttp on 127.0.0.1 answering by a fixed rule (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail_next = 0
        self.garbage = False

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        if self.fail_next:
            self.fail_next -= 1
            return web.json_response({"error": "overloaded"}, status=503)
        content = body["messages"][-1]["content"]
        text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
        if self.garbage:
            reply = "I think so."
        elif "score: N" in text:
            reply = "score: 7"
        elif "Candidate answer:" in text:
            ref = re.search(r"Reference answer: (.*)", text).group(1).strip().lower()
            cand = re.search(r"Candidate answer: (.*)", text).group(1).strip().lower()
            reply = f"correct: {'yes' if ref in cand else 'no'}"
        else:
            reply = '<think>ok</think>\n<response>done</response> trailing text the engine cuts'
        return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": reply}}]})


async def _with_server(fn):
    from aiohttp import web

    server = JudgeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await fn(server, f"http://127.0.0.1:{port}/v1")
    finally:
        await runner.cleanup()


def engine(url, **kw):
    return OpenAIChatEngine(EndpointConfig(base_url=url, model="test-judge", backoff_s=0.01, **kw), cut=False)


def test_llm_judge_verdicts_cache_and_retries(tmp_path):
    cache = tmp_path / "judge.jsonl"

    async def body(server, url):
        e = engine(url)
        judge = LLMJudge(e, cache_path=str(cache))
        assert await judge.judge("Q?", "London", [], "It is London.") == 1.0
        assert await judge.judge("Q?", "London", [], "Paris") == 0.0
        n = len(server.requests)
        assert await judge.judge("Q?", "London", [], "it is london") == 1.0  # same normalised answer: cached
        assert len(server.requests) == n and judge.stats["cache_hits"] == 1
        server.fail_next = 2  # two 503s, then the answer
        assert await judge.judge("Q?", "Rome", [], "Rome") == 1.0
        assert e.stats["retries"] == 2
        fresh = LLMJudge(engine(url), cache_path=str(cache))  # a new process reloads the verdicts
        assert await fresh.judge("Q?", "London", [], "Paris") == 0.0 and fresh.stats["asked"] == 0
        server.garbage = True  # replies without a verdict are a failure, not a 0
        with pytest.raises(EndpointUnavailable):
            await judge.judge("Q?", "Oslo", [], "Oslo")
        await e.close()
        await fresh.engine.close()

    asyncio.run(_with_server(body))
    assert parse_verdict("Reasoning...\ncorrect: no\ncorrect: YES") is True and parse_verdict("yes") is None


def test_unreachable_judge_marks_the_sample_and_its_group():
    async def body():
        dead = engine(f"http://127.0.0.1:{free_port()}/v1", retries=1)  # nothing listens there
        cfg = RewardConfig(judge="llm")
        group = [traj(list(GOOD), final=f"London {i}", group="g1") for i in range(3)]
        other = traj(list(GOOD), group="g2")
        scored = [await score_trajectory(t, QUESTION, cfg, llm_judge=LLMJudge(dead)) for t in group[:1]]
        # the others of g1 were judged by a judge that answered before it went away
        for t in group[1:]:
            t.r_acc, t.judge_status = 1.0, "ok"
        other.judge_status = "ok"
        assert scored[0].judge_status == "failed" and scored[0].reward == 0.0
        assert any(e.startswith("judge_failed:") for e in scored[0].events)
        assert dead.stats["attempts"] == 2 and dead.stats["failures"] == 1
        assert mark_failed_groups([*group, other]) == 2
        assert [t.judge_status for t in group] == ["failed"] * 3 and other.judge_status == "ok"
        await dead.close()

    asyncio.run(body())


def test_process_judge_and_chat_engine_images(tmp_path):
    from PIL import Image

    async def body(server, url):
        e = engine(url)
        t = await score_trajectory(traj(list(GOOD)), QUESTION, RewardConfig(query_scorer="llm"),
                                   process_judge=ProcessJudge(e))
        assert t.r_query == pytest.approx(0.7) and t.reward == pytest.approx(0.8 + 0.2 * 0.7)
        chat = OpenAIChatEngine(EndpointConfig(base_url=url, model="teacher"))
        img = (np.arange(12 * 10 * 3) % 251).astype(np.uint8).reshape(12, 10, 3)
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What?", "images": ["img_1"]},
                {"role": "assistant", "content": "<think>a</think>\n<tool_call>{}</tool_call>"},
                {"role": "tool", "content": "Cropped.", "images": ["img_2"]}]
        out = await chat.chat(msgs, {"img_1": img, "img_2": img[:5]}, Sampling(temperature=0.0))
        assert out == "<think>ok</think>\n<response>done</response>"  # cut after the action
        sent = server.requests[-1]["messages"]
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
        assert sent[3]["content"][0]["text"] == "<tool_response>\nCropped.\n</tool_response>"
        urls = [p["image_url"]["url"] for m in sent[1:] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url"]
        assert len(urls) == 2 and all(u.startswith("data:image/png;base64,") for u in urls)
        back = np.asarray(Image.open(io.BytesIO(base64.b64decode(urls[1].split(",", 1)[1]))))
        assert np.array_equal(back, img[:5])  # lossless: the teacher sees the student's pixels
        await e.close()
        await chat.close()

    asyncio.run(_with_server(body))


# ---------------------------------------------------------------------------
# The rules in detail, and the judges against an in-process engine that records what it is asked


def test_reward_config_checks_and_llm_need():
    RewardConfig(alpha=0.0).check()
    RewardConfig(alpha=1.0).check()
    for alpha in (-0.1, 1.01, 2.0):
        with pytest.raises(ConfigError, match=r"alpha must be in \[0, 1\]"):
            RewardConfig(alpha=alpha).check()
    with pytest.raises(ConfigError, match="judge must be one of"):
        RewardConfig(judge="gpt").check()
    with pytest.raises(ConfigError, match="query_scorer one of"):
        RewardConfig(query_scorer="gpt").check()
    with pytest.raises(ConfigError, match="fmt_scope must be 'prefix' or 'episode'"):
        RewardConfig(fmt_scope="turns").check()
    uses = {(j, q): RewardConfig(judge=j, query_scorer=q).uses_llm() for j in ("rule", "llm", "rule_then_llm")
            for q in ("rule", "llm")}
    assert uses == {("rule", "rule"): False, ("rule", "llm"): True, ("llm", "rule"): True, ("llm", "llm"): True,
                    ("rule_then_llm", "rule"): True, ("rule_then_llm", "llm"): True}


def test_prefix_turns_ends_at_the_cascade_by_default():
    t = traj([turn(i) for i in range(5)], fatal=(1, 3))
    assert [x.index for x in prefix_turns(t)] == [0]
    assert [x.index for x in prefix_turns(t, "kth")] == [0, 1, 2]
    assert [x.index for x in prefix_turns(traj([turn(i) for i in range(3)]))] == [0, 1, 2]


def test_content_words_and_names():
    from osvl.agent.reward import _names, content_words

    assert content_words("The Tower of London, in 1894") == ["tower", "london", "1894"]
    assert _names("over TOWER\n bridge.", "Tower Bridge") and not _names("towers bridge", "Tower Bridge")
    assert not _names("anything", "   ")  # a blank title names nothing


RIVER = {"question": "Which river flows through Lyon?"}  # no path: r_query is the mean of grounded * fresh


@pytest.mark.parametrize("queries, expected", [
    ([], 0.0),                                         # no query and no path
    (["river Lyon", "Lyon river flows"], 1.0),         # grounded in the question; distinct queries are fresh
    (["Lyon zebra"], 1.0),                             # half the content words known: grounded
    (["Lyon zebra giraffe"], 0.0),                     # a third known: not grounded
    (["Lyon zebra", "Lyon zebra giraffe"], 0.5),       # the mean over queries
])
def test_rule_query_score_grounding_without_a_path(queries, expected):
    turns = [turn(i, "text_search", {"query": q}, "No results") for i, q in enumerate(queries)]
    assert rule_query_score(turns, RIVER) == pytest.approx(expected)


def test_rule_query_score_progress_reads_successful_answers_only():
    question = {"question": "Where is it?", "path": [{"title": "England"}]}
    # a title at the end of one answer, then another answer: progress 1; the query names words of the first answer
    ok = [turn(0, "image_search", {"image": "img_1"}, "1. Tower Bridge, England"),
          turn(1, "text_search", {"query": "Tower Bridge England"}, "London")]
    assert rule_query_score(ok, question) == 1.0
    # the same text in an error is neither progress nor something the agent was told
    err = [turn(0, "image_search", {"image": "img_1"}, "Error: Tower Bridge, England", status="error"),
           turn(1, "text_search", {"query": "Tower Bridge"}, "London")]
    assert rule_query_score(err, question) == 0.0


def test_process_judge_prompt_clamp_and_retries():
    engine = RecordingEngine(["score: 15"], fallback="Looks fine.")
    judge = ProcessJudge(engine, observation_chars=5)
    assert asyncio.run(judge.score(list(GOOD), QUESTION)) == 1.0  # 15 / 10 clamped to 1
    (messages, sampling), = engine.calls
    assert [m["role"] for m in messages] == ["user"] and (sampling.temperature, sampling.max_new_tokens) == (0.0, 16)
    lines = messages[0]["content"].splitlines()
    assert f"Question: {QUESTION['question']}" in lines
    calls = lines[lines.index("The agent's tool calls and what they returned:") + 1:]
    assert calls[:3] == ["- image_search({'image': 'img_1'}) -> 1. To",  # observations cut to 5 characters
                         "- text_search({'query': 'Tower Bridge country'}) -> 1. En", ""]  # the answer turn: no line
    engine = RecordingEngine(["no idea", "score: 3\nscore: 7.5"], fallback="Looks fine.")
    assert asyncio.run(ProcessJudge(engine).score([GOOD[2]], {})) == 0.75  # the last score line
    lines = engine.calls[0][0][0]["content"].splitlines()
    assert "Question: " in lines and "(none)" in lines
    # the defaults: two retries, observations cut to 400 characters
    engine = RecordingEngine([], fallback="Looks fine.")
    long = [turn(0, "text_search", {"query": "q"}, "y" * 500)]
    with pytest.raises(EndpointUnavailable, match=r"^process judge judge-a: no 'score: N' verdict$"):
        asyncio.run(ProcessJudge(engine).score(long, QUESTION))
    assert len(engine.calls) == 3
    assert "- text_search({'query': 'q'}) -> " + "y" * 400 in engine.calls[0][0][0]["content"].splitlines()
    with pytest.raises(EndpointUnavailable, match=r"^process judge : no 'score: N' verdict$"):
        asyncio.run(ProcessJudge(RecordingEngine([], name=None, fallback="Looks fine."),
                                 verdict_retries=0).score(list(GOOD), QUESTION))


class ScriptedJudge:
    """An LLM answer judge that records its calls and answers ``verdict`` (or raises it)."""

    def __init__(self, verdict) -> None:
        self.verdict = verdict
        self.calls = []

    async def judge(self, question, answer, aliases, response):
        self.calls.append((question, answer, list(aliases), response))
        if isinstance(self.verdict, Exception):
            raise self.verdict
        return self.verdict


def test_score_trajectory_gold_forms_judges_and_failures():
    def score(t, question=QUESTION, cfg=None, **kw):
        return asyncio.run(score_trajectory(t, question, cfg or RewardConfig(), **kw))

    with pytest.raises(ConfigError, match=r"^judge='llm' needs an llm_judge$"):
        score(traj(list(GOOD)), cfg=RewardConfig(judge="llm"))
    with pytest.raises(ConfigError, match=r"^query_scorer='llm' needs a process_judge$"):
        score(traj(list(GOOD)), cfg=RewardConfig(query_scorer="llm"))
    # no assistant turn at all: r_fmt 0, so the reward is 0 whatever the answer
    t = score(traj([]))
    assert (t.r_fmt, t.r_acc, t.reward) == (0.0, 1.0, 0.0)
    # the question record's gold forms win over the trajectory's copies; missing ones fall back to them
    other = {"question": "Which city?", "answer": "Paris", "answer_aliases": ["Lutetia"]}
    assert score(traj(list(GOOD), final="Lutetia"), other).r_acc == 1.0
    assert score(traj(list(GOOD), final="London"), other).r_acc == 0.0
    assert score(traj(list(GOOD), final="London"), {"question": "Which city?"}).r_acc == 1.0
    assert score(traj(list(GOOD), final="City of London"), {"question": "Which city?"}).r_acc == 1.0
    # an answer given when the episode stopped for another reason does not count
    assert score(traj(list(GOOD), final="London", stop="max_tokens")).r_acc == 0.0
    # judge="llm": the LLM alone decides, asked with the question text and the gold forms
    llm = ScriptedJudge(0.0)
    assert score(traj(list(GOOD), final="London"), cfg=RewardConfig(judge="llm"), llm_judge=llm).r_acc == 0.0
    assert llm.calls == [(QUESTION["question"], "London", ["City of London"], "London")]
    # rule_then_llm: the rule's yes stands, its no goes to the LLM
    llm = ScriptedJudge(1.0)
    cfg = RewardConfig(judge="rule_then_llm")
    assert score(traj(list(GOOD), final="London"), cfg=cfg, llm_judge=llm).r_acc == 1.0 and llm.calls == []
    assert score(traj(list(GOOD), final="the British capital"), cfg=cfg, llm_judge=llm).r_acc == 1.0
    assert len(llm.calls) == 1
    # a judge failure: r_acc and reward 0, marked, the message kept (cut to 200 characters)
    t = score(traj(list(GOOD), final="Paris"), cfg=RewardConfig(judge="llm"),
              llm_judge=ScriptedJudge(EndpointUnavailable("x" * 300)))
    assert (t.r_acc, t.reward, t.judge_status) == (0.0, 0.0, "failed")
    assert t.events == ["judge_failed:" + "x" * 200]
    ok = traj(list(GOOD), group="g")
    ok.events = ["seen"]
    t.group_id = "g"
    assert mark_failed_groups([t, ok]) == 1 and ok.events == ["seen", "judge_failed:group"]
    assert mark_failed_groups([t, ok]) == 0 and t.events == ["judge_failed:" + "x" * 200]
