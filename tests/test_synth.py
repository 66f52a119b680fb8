"""Synthesis units: walks, rewriting, the three invariants, degradation, the LLM rewriter over real HTTP.

Graphs are small KGs written through the real ``osvl.kg.schema.write_kg`` into a temp
folder and read back with ``Graph.load``, so the tests exercise the same code path as
a run on the sample. ``make_kg`` is also used by the pipeline tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest

from osvl.errors import ConfigError
from osvl.kg.schema import write_kg

SYLLABLES = ["ka", "lor", "vim", "tes", "dro", "qua", "zen", "bul", "mir", "fos", "hep", "nor", "sil", "tav"]


def _name(rng: np.random.Generator) -> str:
    return "".join(rng.choice(SYLLABLES, size=3)).capitalize()


def make_kg(root: Path, n: int = 400, n_seeds: int = 12, seed: int = 0, image_size: int = 96) -> Path:
    """A random KG with the shape of the real one: descriptions, categories, attributes, hubs, lists, anchors."""
    rng = np.random.default_rng(seed)
    titles: list[str] = []
    while len(titles) < n:
        t = _name(rng)
        if t not in titles:
            titles.append(t)
    kinds = ["lake", "tower", "river", "valley", "bridge", "harbour", "temple", "forest"]
    entities = []
    for i, t in enumerate(titles):
        entities.append({
            "id": i, "title": t, "aliases": [t + " Major"] if i % 7 == 0 else [],
            # every 5th description is shared by two entities, so some descriptors are not unique
            "description": f"{kinds[i % len(kinds)]} number {i - i % 2 if i % 5 == 0 else i}",
            "text": "", "images": [],
            "categories": [f"subject.Places.{kinds[(i * 3) % len(kinds)].capitalize()}s"],
            "attributes": [{"key": "Code", "value": f"QX {1000 + i}", "source": f"Code: QX {1000 + i}"},
                           {"key": "Founded", "value": f"year {1200 + (i * 7) % 600}", "source": "Founded"}],
            "kind": "list" if i % 50 == 49 else "article", "origin": "wikispeedia",
        })
    links = set()
    hubs = {1, 2}
    for i in range(n):
        for j in rng.choice(n, size=6, replace=False):
            if j != i:
                links.add((i, int(j), "linked_to"))
        for h in hubs:
            links.add((i, h, "linked_to"))  # every page links to the hubs
        if i % 4 == 0:
            links.add((i, (i + 1) % n, "neighbour"))  # a typed relation now and then
    (root / "images").mkdir(parents=True, exist_ok=True)
    anchors = []
    seeds = [int(s) for s in rng.choice(np.arange(3, n), size=n_seeds, replace=False)]
    for k, s in enumerate(seeds):
        img = rng.integers(0, 255, size=(image_size, image_size, 3), dtype=np.uint8)
        img = cv2.GaussianBlur(img, (0, 0), 3)
        name = f"seed{k}.png"
        cv2.imwrite(str(root / "images" / name), img)
        anchors.append({"entity_id": s, "image": name, "caption": f"photo of {titles[s]}", "source": "test",
                        "licence": "CC0", "score": 0.5 + k / (2 * n_seeds), "scorer": "test"})
    write_kg(root, entities, sorted(links), anchors)
    return root


@pytest.fixture(scope="module")
def kg_dir(tmp_path_factory) -> Path:
    return make_kg(tmp_path_factory.mktemp("kg"))


@pytest.fixture(scope="module")
def graph(kg_dir):
    from osvl.synth.walks import Graph

    return Graph.load(kg_dir)


def _rows(graph, n: int = 60, seed: int = 0, key_case: str = "lower"):
    """Template-rewritten, invariant-checked rows, as the pipeline builds them."""
    from osvl.synth.invariants import violations
    from osvl.synth.rewrite import template_rewrite
    from osvl.synth.walks import SPLITS, WalkConfig, random_walk

    split_of = dict.fromkeys(graph.entities, SPLITS[0])
    rng = np.random.default_rng(seed)
    rows, skips, drops = [], Counter(), Counter()
    for _ in range(n * 20):
        if len(rows) >= n:
            break
        s = graph.seeds()[int(rng.integers(len(graph.seeds())))]
        walk = random_walk(graph, s, int(rng.integers(2, 5)), rng, split_of, WalkConfig(hub_in_degree=100), skips)
        draft = walk and template_rewrite(graph, walk, rng, drops, key_case)
        if draft:
            row = {"question": draft.question, "path": draft.path, "answer": draft.answer,
                   "answer_key": draft.answer_key, "answer_aliases": draft.answer_aliases, "hops": len(walk.relations)}
            if not violations(graph, row):
                rows.append(row)
    return rows, skips, drops


def test_walks_skip_hubs_lists_and_cycles(graph):
    from osvl.synth.walks import SPLITS, WalkConfig, random_walk

    split_of = dict.fromkeys(graph.entities, SPLITS[0])
    rng = np.random.default_rng(1)
    skips: Counter[str] = Counter()
    walks = [random_walk(graph, s, 4, rng, split_of, WalkConfig(hub_in_degree=100), skips)
             for s in graph.seeds() for _ in range(20)]
    walks = [w for w in walks if w]
    assert len(walks) > 100
    for w in walks:
        assert len(w.entities) == 5 and len(set(w.entities)) == 5  # no cycle
        through = w.entities[1:-1] if w.answer_entity else w.entities[1:]
        assert not {1, 2} & set(through)  # hubs (in-degree ~400) never walked through
        assert not any(graph.entities[e].list_page for e in w.entities[1:])
        if w.answer_entity:  # "the <relation> of ...": the relation's one target from the entity before it
            assert w.answer == graph.entities[w.entities[-1]].title and w.answer_key == w.relations[-1] != "linked_to"
            assert [d for d, r in graph.links_from[w.entities[-2]] if r == w.answer_key] == [w.entities[-1]]
        else:
            assert (w.answer_key, w.answer) in graph.entities[w.entities[-1]].answers
        assert len(w.answer.split()) <= 6
        for a, b, rel in zip(w.entities, w.entities[1:], w.relations, strict=False):
            assert (b, rel) in graph.links_from[a]
    assert skips["hub"] > 0 and skips["list_page"] > 0
    assert 0 < sum(w.answer_entity for w in walks) < len(walks)


def test_a_development_split_is_disjoint_from_heldout_and_leaves_the_others_as_they_were(graph):
    """A fourth share makes ``dev`` (where settings are tuned on figures) beside ``heldout`` (only reported on): no
    seed, and no entity, is in both; a three-share config is the same assignment as a four-share one with dev 0."""
    from osvl.synth.walks import assign_splits

    seeds = graph.seeds()
    three = assign_splits(graph, seeds, {"sft": 0.6, "rl": 0.3, "heldout": 0.1},
                          {"sft": 0.5, "rl": 0.3, "heldout": 0.2}, run_seed=3)
    zero = assign_splits(graph, seeds, {"sft": 0.6, "rl": 0.3, "heldout": 0.1, "dev": 0.0},
                         {"sft": 0.5, "rl": 0.3, "heldout": 0.2, "dev": 0.0}, run_seed=3)
    assert three == zero and "dev" not in set(three.values())
    four = assign_splits(graph, seeds, {"sft": 0.4, "rl": 0.2, "heldout": 0.2, "dev": 0.2},
                         {"sft": 0.4, "rl": 0.2, "heldout": 0.2, "dev": 0.2}, run_seed=3)
    dev = {s for s in seeds if four[s] == "dev"}
    held = {s for s in seeds if four[s] == "heldout"}
    assert dev and held and not dev & held
    assert {e for e, s in four.items() if s == "dev"}.isdisjoint({e for e, s in four.items() if s == "heldout"})
    # four shares deal (sft + rl, heldout, dev) as three shares deal (sft, rl, heldout), then sft + rl apart:
    # a three-share held-out split becomes dev and its rl split a fresh held-out one, every seed and entity
    # of its sft split staying in sft or rl (how the demo moved its tuned-on held-out split, configs/grpo/demo.yaml)
    old = assign_splits(graph, seeds, {"sft": 0.45, "rl": 0.2, "heldout": 0.35},
                        {"sft": 0.4, "rl": 0.25, "heldout": 0.35}, run_seed=3)
    moved = assign_splits(graph, seeds, {"sft": 0.25, "rl": 0.2, "heldout": 0.2, "dev": 0.35},
                          {"sft": 0.25, "rl": 0.15, "heldout": 0.25, "dev": 0.35}, run_seed=3)
    assert set(moved) == set(old) == set(graph.entities)
    assert {e: {"heldout": "dev", "rl": "heldout"}.get(s, "train") for e, s in old.items()} == {
        e: "train" if s in ("sft", "rl") else s for e, s in moved.items()}
    assert Counter(moved[s] for s in seeds if old[s] == "sft") == {"sft": 3, "rl": 3}
    from osvl.errors import ConfigError
    from osvl.synth.job import SynthConfig, validate

    validate(SynthConfig(split_fractions=[0.4, 0.2, 0.2, 0.2], entity_split_fractions=[0.4, 0.2, 0.2, 0.2]))
    for seeds_f, entity_f in (([0.4, 0.2, 0.2, 0.2], [0.5, 0.3, 0.2]), ([0.4, 0.2, 0.2, 0.2], [0.5, 0.3, 0.2, 0.0]),
                              ([0.5, 0.5], [0.5, 0.5])):
        with pytest.raises(ConfigError, match="split_fractions|dev"):
            validate(SynthConfig(split_fractions=seeds_f, entity_split_fractions=entity_f))


def test_walks_stay_inside_the_seed_split(graph):
    from osvl.synth.walks import SPLITS, WalkConfig, assign_splits, random_walk

    seeds = graph.seeds()
    split_of = assign_splits(graph, seeds, {"sft": 0.6, "rl": 0.3, "heldout": 0.1},
                             {"sft": 0.5, "rl": 0.3, "heldout": 0.2}, run_seed=3)
    assert set(split_of) == set(graph.entities) and set(split_of.values()) == set(SPLITS) - {"dev"}
    assert Counter(split_of[s] for s in seeds) == {"sft": 7, "rl": 4, "heldout": 1}
    rng = np.random.default_rng(0)
    skips: Counter[str] = Counter()
    for s in seeds:
        for _ in range(10):
            w = random_walk(graph, s, 3, rng, split_of, WalkConfig(hub_in_degree=100), skips)
            if w:
                walked = w.entities[:-1] if w.answer_entity else w.entities  # an asked entity is a value: any split
                assert {split_of[e] for e in walked} == {split_of[s]}
    assert skips["other_split"] > 0


def test_template_questions_pass_invariants_and_name_nothing(graph):
    from osvl.synth.invariants import fold

    rows, _, _ = _rows(graph)
    assert len(rows) == 60
    for row in rows:
        text = f" {fold(row['question'])} "
        for step in row["path"]:
            assert f" {fold(step['title'])} " not in text
        assert f" {fold(row['answer'])} " not in text
        assert row["question"].startswith(f"What is the {row['answer_key'].lower()} of ")
    assert {s["descriptor_kind"] for r in rows for s in r["path"][1:]} >= {"description", "category", "attribute"}


def test_planted_leak_is_rejected(graph):
    from osvl.synth.invariants import violations

    rows, _, _ = _rows(graph, n=10)
    row = rows[0]
    assert violations(graph, row) == []
    title = row["path"][1]["title"]
    accented = title[0] + "\u0301" + title[1:].upper()  # accents and case must not hide a name
    assert violations(graph, {**row, "question": row["question"][:-1] + f" near {accented}?"}) == ["leak"]
    assert violations(graph, {**row, "question": row["question"] + " " + row["answer"].lower()}) == ["leak"]
    # a substring that is not a whole word is not a leak
    assert violations(graph, {**row, "question": row["question"] + " x" + title.lower()}) == []


def test_non_unique_descriptor_is_rejected(graph):
    from osvl.synth.invariants import violations

    rows, _, _ = _rows(graph, n=40)
    checked = 0
    for row in rows:
        for hop in range(1, len(row["path"])):
            step = row["path"][hop]
            if step["relation"] != "linked_to":
                continue
            prev = row["path"][hop - 1]["entity_id"]
            # the category of the hubs: every page links to both hubs, so a descriptor both share is ambiguous
            nb = graph.neighbours(prev)
            shared = Counter(c for x in nb for c in graph.entities[x].categories)
            cat = next((c for c, k in shared.items() if k >= 2), None)
            if cat is None:
                continue
            path = [dict(p) for p in row["path"]]
            path[hop].update(descriptor_kind="category", descriptor_key="", descriptor_value=cat)
            assert f"non_unique_hop{hop}" in violations(graph, {**row, "path": path})
            checked += 1
            break
    assert checked >= 10


def test_changed_answer_is_rejected(graph):
    from osvl.synth.invariants import violations

    rows, _, _ = _rows(graph, n=10)
    row = rows[0]
    assert violations(graph, {**row, "answer": row["answer"] + "1"}) == ["answer_changed"]
    other_key = "Founded" if row["answer_key"] == "Code" else "Code"
    assert violations(graph, {**row, "answer_key": other_key}) == ["answer_changed"]
    # a final entity that the structured form does not reach
    path = [dict(p) for p in row["path"]]
    path[-1]["entity_id"] = next(e for e in graph.entities if e != path[-1]["entity_id"] and e not in (1, 2))
    assert "answer_changed" in violations(graph, {**row, "path": path})


def test_visual_reference_follows_category(kg_dir):
    from osvl.synth.rewrite import visual_reference
    from osvl.synth.walks import Graph

    ents = [{"id": 0, "title": "Cat", "description": "Small domesticated carnivorous mammal", "categories": []},
            {"id": 1, "title": "Big Ben", "description": "",
             "categories": ["subject.Design_and_Technology.Architecture"]},
            {"id": 2, "title": "Thing", "description": "", "categories": []}]
    g = Graph(ents, [])
    assert [visual_reference(g, i) for i in range(3)] == [
        "the animal shown", "the building in the image", "the subject of the image"]


@pytest.mark.parametrize("kind,tool", [("blur", "sharpen"), ("downsample", "super_resolution"),
                                       ("perspective", "perspective_correct")])
def test_degradations_record_parameters_and_undo_tool(kind, tool):
    from osvl.synth.degrade import degrade

    img = cv2.resize(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8), (120, 90),
                     interpolation=cv2.INTER_NEAREST)
    out, rec = degrade(img, kind, np.random.default_rng(5))
    again, rec2 = degrade(img, kind, np.random.default_rng(5))
    assert rec == rec2 and np.array_equal(out, again)  # reproducible from the recorded parameters
    assert rec["kind"] == kind and rec["undo_tool"] == tool
    json.dumps(rec)
    if kind == "downsample":
        f = rec["factor"]
        assert out.shape == (90 // f, 120 // f, 3)
    else:
        assert out.shape == img.shape and np.abs(out.astype(int) - img).mean() > 5
    if kind == "perspective":
        h = np.array(rec["homography"])
        corner = h @ np.array([0, 0, 1.0])
        assert np.allclose(corner[:2] / corner[2], rec["corners"][0], atol=0.5)
    with pytest.raises(ConfigError):
        degrade(img, "sepia", np.random.default_rng(0))


def test_kg_key_case_spells_the_answer_key_as_the_kg_does(graph):
    """``rewriter.key_case=kg``: the same questions, the answer key in the KG's own case ("the Field of"), so
    that it is the same text as the "Field: ..." line a search result shows."""
    lower, _, _ = _rows(graph, n=30)
    kg, _, _ = _rows(graph, n=30, key_case="kg")
    assert [r["path"] for r in kg] == [r["path"] for r in lower]
    assert any(r["answer_key"] != r["answer_key"].lower() for r in kg)  # the check below can fail
    for a, b in zip(lower, kg, strict=True):
        key = b["answer_key"]
        assert b["question"].startswith(f"What is the {key} of ")
        assert b["question"] == a["question"].replace(key.lower(), key, 1)


def test_config_rejects_bad_values():
    from osvl.config import apply_override
    from osvl.synth.job import SynthConfig, validate

    for key, value in [("walk.hop_probs", "0.5,0.6,0.2"), ("split_fractions", "0.5,0.5"),
                       ("degrade.kinds", "blur,sepia"), ("rewriter.kind", "llm"),
                       ("rewriter.key_case", "upper")]:
        with pytest.raises(ConfigError):
            validate(apply_override(SynthConfig(), key, value))
    validate(SynthConfig())


class ChatServer:
    """A tiny OpenAI-compatible chat-completions server on loopback (aiohttp), answering by a rule."""

    def __init__(self, reply):
        self.reply, self.requests = reply, []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        from aiohttp import web

        async def handle(request):
            body = await request.json()
            self.requests.append(body)
            question = body["messages"][-1]["content"].split("Question: ", 1)[1]
            status, text = self.reply(question)
            if status != 200:
                return web.Response(status=status, text="overloaded")
            return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": text}}]})

        async def start():
            app = web.Application()
            app.router.add_post("/v1/chat/completions", handle)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_llm_rewriter_over_http_keeps_only_safe_paraphrases(graph):
    from osvl.endpoint import EndpointConfig
    from osvl.synth.invariants import violations
    from osvl.synth.rewrite import Draft, llm_rewrite

    rows, _, _ = _rows(graph, n=9)
    drafts = [Draft(r["question"], r["path"], r["answer_key"], r["answer"], r["answer_aliases"]) for r in rows]
    by_question = {d.question: (i, d) for i, d in enumerate(drafts)}

    def reply(question):
        i, d = by_question[question]
        if i % 3 == 0:  # a fluent paraphrase: same descriptors, new frame
            return 200, "Tell me: " + question[len("What is "):].rstrip("?") + "?"
        if i % 3 == 1:  # a paraphrase that names the final entity: must be refused
            return 200, question.rstrip("?") + f", i.e. {d.path[-1]['title']}?"
        return 503, ""  # for good: still failing after the retries

    with ChatServer(reply) as server:
        cfg = EndpointConfig(base_url=f"http://127.0.0.1:{server.port}/v1", model="tiny", max_concurrency=3,
                             retries=1, backoff_s=0.01)
        counts: Counter[str] = Counter()
        texts = llm_rewrite(cfg, graph, drafts, counts)
    assert len(server.requests) == 9 + 3 and server.requests[0]["model"] == "tiny"  # each 503 asked twice
    assert counts == {"llm_used": 3, "llm_leak": 3, "llm_error": 3}
    for i, (text, row) in enumerate(zip(texts, rows, strict=True)):
        if i % 3 == 0:
            assert text.startswith("Tell me: ") and not violations(graph, {**row, "question": text})
        else:
            assert text == row["question"]


def test_llm_rewriter_retries_after_a_5xx(graph):
    """A rewrite whose first request meets an overloaded server (503) is asked again and used."""
    from osvl.endpoint import EndpointConfig
    from osvl.synth.rewrite import Draft, llm_rewrite

    rows, _, _ = _rows(graph, n=2)
    drafts = [Draft(r["question"], r["path"], r["answer_key"], r["answer"], r["answer_aliases"]) for r in rows]
    seen: Counter[str] = Counter()

    def reply(question):
        seen[question] += 1
        if seen[question] == 1:
            return 503, ""
        return 200, "Tell me: " + question[len("What is "):].rstrip("?") + "?"

    with ChatServer(reply) as server:
        cfg = EndpointConfig(base_url=f"http://127.0.0.1:{server.port}/v1", model="tiny", backoff_s=0.01)
        counts: Counter[str] = Counter()
        texts = llm_rewrite(cfg, graph, drafts, counts)
    assert len(server.requests) == 4 and set(seen.values()) == {2}
    assert counts == {"llm_used": 2} and all(t.startswith("Tell me: ") for t in texts)


def test_llm_rewriter_missing_key_env_is_a_config_error(graph):
    from osvl.endpoint import EndpointConfig
    from osvl.synth.rewrite import Draft, llm_rewrite

    rows, _, _ = _rows(graph, n=1)
    d = Draft(rows[0]["question"], rows[0]["path"], rows[0]["answer_key"], rows[0]["answer"], [])
    cfg = EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m", api_key_env="OSVL_TEST_UNSET_KEY_VAR")
    with pytest.raises(ConfigError, match="rewriter.endpoint.api_key_env"):
        llm_rewrite(cfg, graph, [d], Counter())


def test_shard_synthesis_with_the_llm_rewriter(graph, tmp_path):
    """A whole shard through the LLM path: safe paraphrases are used and recorded, the rest keep the template."""
    from osvl.config import apply_override
    from osvl.synth.invariants import violations
    from osvl.synth.job import SynthConfig
    from osvl.synth.pipeline import ImageStore, plan, synthesize_shard

    def reply(question):
        if sum(map(ord, question)) % 2:
            return 200, "Quick one: " + question
        return 200, question.split(" of ", 1)[0] + " of the thing in the image?"  # lost every descriptor

    with ChatServer(reply) as server:
        cfg = SynthConfig(num_shards=2, questions_per_seed=6)
        for key, value in [("rewriter.kind", "llm"),
                           ("rewriter.endpoint.base_url", f"http://127.0.0.1:{server.port}/v1"),
                           ("rewriter.endpoint.model", "tiny")]:
            cfg = apply_override(cfg, key, value)
        shards, split_of = plan(graph, cfg)
        rows, counts = synthesize_shard(graph, cfg, 0, shards[0], split_of, ImageStore(graph, tmp_path / "img"))
    assert len(rows) == 6 * len(shards[0]) and len(server.requests) == len(rows)
    used = [r for r in rows if r["provenance"]["rewriter"] == "llm:tiny"]
    assert 0 < len(used) < len(rows) and counts["rewriter"]["llm_used"] == len(used)
    assert counts["rewriter"]["llm_dropped_descriptor"] == len(rows) - len(used)
    for r in rows:
        assert not violations(graph, r)
        assert r["question"].startswith("Quick one: ") or " mentioned in the article on " in r["question"]
    assert all(r["question"].startswith("Quick one: ") for r in used)


def test_resume_refuses_shards_of_another_kg(tmp_path):
    from osvl.synth.pipeline import check_same_kg
    from osvl.synth.walks import Graph

    kg = make_kg(tmp_path / "kg", n=60, n_seeds=3)
    shards = tmp_path / "run" / "shards"
    check_same_kg(Graph.load(kg), shards)
    check_same_kg(Graph.load(kg), shards)  # same KG: resume is fine
    make_kg(kg, n=60, n_seeds=3, seed=1)  # rebuilt with other links
    with pytest.raises(ConfigError, match="another KG"):
        check_same_kg(Graph.load(kg), shards)


def test_fast_fold_equals_the_kg_fold():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from osvl.kg.schema import fold as kg_fold
    from osvl.synth.invariants import fold

    @settings(max_examples=400, deadline=None)
    @given(st.text())
    def same(text):
        assert fold(text) == kg_fold(text)

    same()
    for text in ["Chichén Itzá", "Mercury (planet)", "GDP ( PPP) - Per capita", "Ærø_island", "ﬁsh"]:
        assert fold(text) == kg_fold(text)
