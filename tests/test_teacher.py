"""The path-oracle teacher through the real agent loop and the real in-process tools.

What it must never do: name something the conversation has not shown. Every path entity in
a query, every content word of a query and every answer must occur in the question or in
an earlier tool response; a degraded image is restored before any image search; a wrong
answer is never given (the oracle gives up instead, and the judge filters that out).
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from _questions import sample_questions

from osvl.agent.judge import answer_reward, normalize_answer
from osvl.agent.teacher import GIVE_UP, PathOracle, find_span, read_conversation
from osvl.chat import parse_turn

TOOL_NAMES = ["crop", "sharpen", "super_resolution", "perspective_correct", "ocr", "text_search", "image_search"]
GLUE = {"of"}  # the only word the oracle adds to a query ("Capital of X")


def test_find_span_copies_from_the_text():
    text = "1. Star Trek  The Original Series\n   Ironbridge Gorge; iron works"
    assert find_span("star trek the original series", text) == "Star Trek  The Original Series"
    assert find_span("Iron", text) == "iron"  # whole words only: not the "Iron" inside "Ironbridge"
    assert find_span("Iron bridge", text) is None


def test_read_conversation_pairs_calls_and_answers():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Q?", "images": ["img_1"]},
            {"role": "assistant", "content": '<think>a</think>\n<tool_call>{"name": "sharpen", "arguments": '
                                             '{"image": "img_1"}}</tool_call>'},
            {"role": "tool", "content": "Sharpened img_1 as img_2.", "images": ["img_2"]},
            {"role": "assistant", "content": "garbage"},
            {"role": "tool", "content": "Error (invalid_call): missing_tag", "images": []}]
    question, images, steps = read_conversation(msgs)
    assert question == "Q?" and images == ["img_1"]
    assert len(steps) == 1 and steps[0].name == "sharpen" and steps[0].ok and steps[0].new_images == ["img_2"]


def run_oracle(qdir, rows, seeds, oracle_cfg=None):
    """(row, trajectory) of the oracle (``oracle_cfg``; None = defaults) on ``rows`` x ``seeds`` through the
    real agent loop and the real in-process tools."""
    from osvl.agent.env import build_env
    from osvl.agent.loop import AgentConfig, run_episode
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint
    from osvl.tools.registry import all_tools

    processor = load_processor(tiny_checkpoint("qwen3_vl"))
    tools = [t.schema for t in all_tools().values()]
    cfg = AgentConfig(max_turns=16, max_new_tokens=512, max_episode_tokens=8192)

    async def run_all():
        client = build_env().client  # the agent's environment, default search settings
        sem = asyncio.Semaphore(8)

        async def one(row, seed):
            from PIL import Image

            with Image.open(qdir / "images" / row["images"][0]) as im:
                image = np.asarray(im.convert("RGB"))
            async with sem:
                return row, await run_episode(PathOracle(row, seed=seed, cfg=oracle_cfg), row, [image], client, cfg,
                                              processor=processor, tools=tools, seed=seed)

        out = await asyncio.gather(*(one(r, s) for r in rows for s in seeds))
        await client.close()
        return out

    return asyncio.run(run_all())


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """The sample's synthesized questions (folder)."""
    return sample_questions(str(tmp_path_factory.mktemp("questions")))


@pytest.fixture(scope="module")
def episodes(questions):
    """Every sample question answered twice (two seeds) by the oracle through the real loop and tools."""
    return run_oracle(questions, pq.read_table(questions / "sft.parquet").to_pylist(), (0, 1))


@pytest.mark.slow
def test_oracle_acts_only_on_what_the_conversation_shows(episodes):
    assert len(episodes) >= 40
    for row, traj in episodes:
        seen = [row["question"]]
        titles = [p["title"] for p in row["path"]]
        assert traj.kind == "teacher" and traj.stop_reason == "response"
        for t in traj.turns:
            parsed = parse_turn(t.text, TOOL_NAMES)  # every turn is well formed, with a short thought
            assert 0 < len(parsed.think) < 400
            before = "\n".join(seen)
            if t.tool == "text_search":
                query = t.arguments["query"]
                for title in titles:
                    if find_span(title, query):
                        assert find_span(title, before), f"{title!r} named in {query!r} before any response"
                words = set(re.findall(r"\w+", before.lower())) | GLUE
                assert set(re.findall(r"\w+", query.lower())) <= words, (query, row["id"])
            if t.action == "response" and traj.final_answer != GIVE_UP:
                assert find_span(traj.final_answer, before), (traj.final_answer, row["id"])
            if t.status == "ok":
                seen.append(t.observation)


@pytest.mark.slow
def test_oracle_restores_first_and_never_answers_wrong(episodes):
    degraded = 0
    correct = 0
    for row, traj in episodes:
        calls = [t.tool for t in traj.turns if t.action == "tool_call"]
        if row["degraded"]:
            degraded += 1
            undo = json.loads(row["degradation"])["undo_tool"]
            assert undo in calls and calls.index(undo) < calls.index("image_search"), (row["id"], calls)
        ok = answer_reward(traj.final_answer, row["answer"], row["answer_aliases"])
        assert ok or traj.final_answer == GIVE_UP, (traj.final_answer, row["answer"])
        correct += ok
    assert degraded >= 4
    rate = correct / len(episodes)
    print(f"oracle: {correct}/{len(episodes)} correct ({rate:.0%}) on the sample's questions")
    assert rate >= 0.85  # 100% measured with the v2 index (numbers, facts, links, query-centred snippets)


@pytest.mark.slow
def test_oracle_varies_wording_between_rollouts(episodes):
    by_q: dict[str, list[str]] = {}
    for row, traj in episodes:
        by_q.setdefault(row["id"], []).append("\n".join(t.text for t in traj.turns))
    differ = sum(len(set(texts)) > 1 for texts in by_q.values())
    assert differ >= len(by_q) // 2
    # the same seed gives the same turns: the teacher is a pure function of the conversation
    row, traj = episodes[0]
    msgs = [{"role": "user", "content": row["question"], "images": ["img_1"]}]
    assert PathOracle(row, seed=0).next_turn(msgs) == traj.turns[0].text
    assert normalize_answer(traj.question) == normalize_answer(row["question"])


@pytest.mark.slow
def test_brief_think_keeps_the_actions_and_fixes_the_thought(episodes):
    """think="brief" (the tiny demo student's setting): the same action each turn as the full oracle,
    the thought one fixed phrase per action."""
    from osvl.agent.teacher import BRIEF_THINK, OracleConfig

    for row, traj in episodes[:10]:
        brief = PathOracle(row, seed=0, cfg=OracleConfig(think="brief"))
        full = PathOracle(row, seed=0)
        msgs = [{"role": "user", "content": row["question"], "images": ["img_1"]}]
        for t in traj.turns[:3]:
            a, b = parse_turn(full.next_turn(msgs), TOOL_NAMES), parse_turn(brief.next_turn(msgs), TOOL_NAMES)
            assert (b.action, b.name, b.arguments, b.response) == (a.action, a.name, a.arguments, a.response)
            assert b.think == BRIEF_THINK.get(b.name or "response", BRIEF_THINK["restore"])
            if t.action != "tool_call":
                break
            msgs += [{"role": "assistant", "content": t.text},
                     {"role": "tool", "content": t.observation, "images": t.new_images}]


@pytest.mark.slow
def test_fixed_wording_and_copy_space_give_one_demonstration_per_question(episodes):
    """wording="fixed" with reorder_prob 0 (the demo's setting): seeds no longer change a turn; copy_space puts
    a space before every query and answer, which the tools and the judge ignore (same search, same verdict)."""
    from osvl.agent.teacher import OracleConfig

    fixed = OracleConfig(wording="fixed", reorder_prob=0.0)
    spaced = OracleConfig(wording="fixed", reorder_prob=0.0, copy_space=True)
    varied = 0
    for row, traj in episodes[:16:2]:
        msgs = [{"role": "user", "content": row["question"], "images": ["img_1"]}]
        for t in traj.turns:
            one, two = (PathOracle(row, seed=s, cfg=fixed).next_turn(msgs) for s in (0, 1))
            assert one == two
            a, b = parse_turn(one, TOOL_NAMES), parse_turn(PathOracle(row, seed=5, cfg=spaced).next_turn(msgs),
                                                           TOOL_NAMES)
            if a.name == "text_search":
                assert b.arguments["query"] == " " + a.arguments["query"]
            elif a.action == "response":
                assert b.response == " " + a.response
                assert normalize_answer(b.response) == normalize_answer(a.response)
            else:
                assert b.arguments == a.arguments
            if t.action != "tool_call":
                break
            varied += PathOracle(row, seed=0).next_turn(msgs) != PathOracle(row, seed=1).next_turn(msgs)
            msgs += [{"role": "assistant", "content": t.text},
                     {"role": "tool", "content": t.observation, "images": t.new_images}]
    assert varied  # the default still draws: the fixed seeds above were a real test


@pytest.mark.slow
def test_verbatim_queries_copy_the_questions_clause_whole(episodes):
    """verbatim: an attribute hop's query is the question's own words ("currency is X"), one contiguous span;
    everything else the oracle writes is unchanged."""
    from osvl.agent.teacher import OracleConfig

    plain, verbatim = OracleConfig(wording="fixed", reorder_prob=0.0), OracleConfig(wording="fixed", reorder_prob=0.0,
                                                                                   verbatim=True)
    clauses = 0
    for row, traj in episodes[:16]:
        msgs = [{"role": "user", "content": row["question"], "images": ["img_1"]}]
        for t in traj.turns:
            a, b = (parse_turn(PathOracle(row, seed=0, cfg=c).next_turn(msgs), TOOL_NAMES) for c in (plain, verbatim))
            if a.name == "text_search" and a.arguments != b.arguments:
                q = b.arguments["query"]  # the clause query, or the answer query that ends with the clause
                head, tail = q.split(" is ", 1)
                assert q.replace(" is ", " ", 1) == a.arguments["query"]
                assert f"{head.split()[-1]} is {tail.split()[0]}".lower() in row["question"].lower()
                clauses += 1
            else:
                assert (a.name, a.arguments, a.response) == (b.name, b.arguments, b.response)
            if t.action != "tool_call":
                break
            msgs += [{"role": "assistant", "content": t.text},
                     {"role": "tool", "content": t.observation, "images": t.new_images}]
    assert clauses  # the sample has attribute hops: the option changed something


@pytest.mark.slow
def test_in_order_searches_each_hop_once_in_path_order(questions):
    """in_order: the text searches resolve hop 1, 2, ... in path order, each by a search made after the previous
    hop was resolved, even where a response named a later hop first (which the default oracle then skips)."""
    from osvl.agent.teacher import OracleConfig

    rows = pq.read_table(questions / "sft.parquet").to_pylist()[:16]
    skipped = 0
    for row, traj in run_oracle(questions, rows, (0,), OracleConfig(wording="fixed", reorder_prob=0.0, in_order=True)):
        if traj.final_answer == GIVE_UP:
            continue
        hops = [p["title"] for p in row["path"][1:]]
        at = 0  # the hop the next search is for
        for t in traj.turns:
            if t.tool == "text_search" and at < len(hops):
                later = [h for h in hops[at + 1:] if find_span(h, t.observation)]
                if find_span(hops[at], t.observation):
                    at += 1
                skipped += bool(later)  # a snippet named a later hop: the search for it still comes
        assert at == len(hops), (row["id"], hops, [t.arguments for t in traj.turns])
    assert skipped  # a response named a later hop (the default oracle marks it found) and it was still searched


@pytest.mark.slow
def test_look_up_answers_right_after_a_search_copied_from_the_question(questions):
    """look_up (with verbatim): after the last hop the oracle always searches "<answer key> <last hop's
    descriptor>", both as the question spells them, and answers after it, even where an earlier response
    already showed the answer."""
    from osvl.agent.teacher import OracleConfig

    rows = pq.read_table(questions / "sft.parquet").to_pylist()[:16]
    cfg = OracleConfig(wording="fixed", reorder_prob=0.0, in_order=True, look_up=True, verbatim=True)
    answered = early = 0
    for row, traj in run_oracle(questions, rows, (0,), cfg):
        if traj.final_answer == GIVE_UP:
            continue
        key = find_span(row["answer_key"], row["question"])
        if key is None:  # no key to look up with: the oracle names the entity instead
            continue
        answered += 1
        *calls, answer = traj.turns
        assert answer.action == "response"
        looks = [i for i, t in enumerate(calls) if t.tool == "text_search"
                 and t.arguments["query"].strip().lower().startswith(key.lower() + " ")]
        assert looks, (key, [t.arguments for t in calls])
        query = calls[looks[0]].arguments["query"].strip()
        assert query[len(key) + 1:] in row["question"], (query, row["question"])
        early += any(find_span(traj.final_answer.strip(), t.observation) for t in calls[:looks[0]])
    assert answered >= 8 and early  # some answers were on view before the look-up: the option changed those


@pytest.mark.slow
def test_quote_reads_the_answer_at_its_key_and_copies_it_from_the_quote(questions):
    """quote: the answer turn's thought is the latest response's "Key: answer" line, spelled as the response
    spells it (the key is the question's answer key), and the answer is the value that line ends with."""
    from osvl.agent.teacher import OracleConfig

    rows = pq.read_table(questions / "sft.parquet").to_pylist()[:16]
    cfg = OracleConfig(wording="fixed", reorder_prob=0.0, think="brief", in_order=True, look_up=True,
                       verbatim=True, copy_space=True, quote=True)
    quoted = 0
    for row, traj in run_oracle(questions, rows, (0,), cfg):
        if traj.final_answer == GIVE_UP:
            continue
        last = traj.turns[-1]
        thought = re.search(r"<think>(.*?)</think>", last.text, re.S).group(1)
        if thought == "The results give the answer.":  # no "Key: answer" line on view: the brief thought
            assert not any(f"{row['answer_key']}: ".lower() + traj.final_answer.strip().lower() in
                           t.observation.lower() for t in traj.turns[:-1])
            continue
        quoted += 1
        assert thought.startswith("The results give the answer. ")  # the decision first, then the quote
        thought = thought.removeprefix("The results give the answer.")
        key, value = thought.strip().split(": ", 1)
        assert key.lower() == row["answer_key"].lower() and value == traj.final_answer.strip()
        seen = [t.observation for t in traj.turns[:-1] if thought.strip() in t.observation]
        assert seen, thought  # copied from a response, spelling included
    assert quoted >= 8


@pytest.mark.slow
def test_look_up_top_k_leaves_one_result_to_read_the_answer_from(questions):
    """look_up_top_k=1: the look-up search (after every hop) asks for one result and its response lists one;
    the hop searches before it keep top_k."""
    from osvl.agent.teacher import OracleConfig

    rows = pq.read_table(questions / "sft.parquet").to_pylist()[:16]
    cfg = OracleConfig(wording="fixed", reorder_prob=0.0, think="brief", in_order=True, look_up=True,
                       verbatim=True, copy_space=True, look_up_top_k=1)
    looked = read_there = 0
    for row, traj in run_oracle(questions, rows, (0,), cfg):
        key = find_span(row["answer_key"], row["question"])
        if traj.final_answer == GIVE_UP or key is None:
            continue
        calls = traj.turns[:-1]
        searches = [t for t in calls if t.tool == "text_search"]
        ones = [i for i, t in enumerate(searches) if t.arguments["top_k"] == 1]
        assert len(ones) == 1, [t.arguments for t in searches]
        look = searches[ones[0]]
        assert look.arguments["query"].strip().lower().startswith(key.lower() + " ")
        assert all(t.arguments["top_k"] in (cfg.top_k, cfg.retry_top_k) for t in searches[:ones[0]])
        assert re.findall(r"^\d+\. ", look.observation, re.M) == ["1. "]
        looked += 1
        read_there += look is calls[-1] and find_span(traj.final_answer.strip(), look.observation) is not None
    assert looked >= 8 and read_there >= looked // 2


def test_recall_answers_matching_questions_at_once_and_nothing_else_changes(questions):
    """recall: a question that recall_match finds is answered in the first turn, with the path's answer (which the
    judge accepts), for about ``recall`` of them by a draw per question that the seed moves; every other question
    gets the same first turn as without the option. A pattern that is not a regular expression fails typed."""
    from osvl.agent.teacher import OracleConfig
    from osvl.errors import ConfigError

    rows = pq.read_table(questions / "sft.parquet").to_pylist()
    keys = sorted({r["answer_key"] for r in rows})
    remembered = keys[: max(1, len(keys) // 2)]
    pattern = "^what is the (" + "|".join(re.escape(k) for k in remembered) + ") of "
    plain = OracleConfig(wording="fixed", reorder_prob=0.0, copy_space=True)
    recall = OracleConfig(wording="fixed", reorder_prob=0.0, copy_space=True, recall=0.5, recall_match=pattern)
    answered: dict[int, set[str]] = {0: set(), 1: set()}
    for row in rows:
        msgs = [{"role": "user", "content": row["question"], "images": ["img_1"]}]
        for seed in answered:
            turn = parse_turn(PathOracle(row, seed=seed, cfg=recall).next_turn(msgs), TOOL_NAMES)
            if turn.action == "response":
                assert row["answer_key"] in remembered
                assert answer_reward(turn.response, row["answer"], row.get("answer_aliases") or ()) == 1.0
                answered[seed].add(row["id"])
            else:
                assert turn == parse_turn(PathOracle(row, seed=seed, cfg=plain).next_turn(msgs), TOOL_NAMES)
    n = sum(r["answer_key"] in remembered for r in rows)
    assert all(0 < len(ids) < n for ids in answered.values())  # a draw, not every matching question
    assert answered[0] != answered[1]  # the seed moves the draw
    always = OracleConfig(recall=1.0)  # every question
    assert all(parse_turn(PathOracle(r, cfg=always).next_turn([{"role": "user", "content": r["question"]}]),
                          TOOL_NAMES).action == "response" for r in rows)
    with pytest.raises(ConfigError, match="recall_match"):
        PathOracle(rows[0], cfg=OracleConfig(recall=0.5, recall_match="(unclosed"))
