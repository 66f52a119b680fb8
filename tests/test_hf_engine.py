"""The HF token engine through the real loop: token-exact policy records that re-score to their log-probs.

The model is the tiny Qwen3-VL fine-tuned on scripted crop -> text_search -> response episodes
(``osvl.agent.scripted``, built once and cached), sampled at temperature 1.0, no forced
decoding: the episodes below are whatever it samples, with the real tools in-process.
"""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch

from osvl.agent import scripted
from osvl.agent.engines import make_engine
from osvl.agent.engines.base import GenRequest, Sampling
from osvl.agent.env import build_env
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.trajectory import (
    TrajectoryBuilder,
    load_image,
    processor_inputs,
    read_trajectories,
    write_trajectories,
)
from osvl.errors import ConfigError
from osvl.models.tiny import tiny_checkpoint

pytestmark = pytest.mark.slow
N_EPISODES = 8


@pytest.fixture(scope="module")
def engine():
    # one torch thread, as rollout actors run: the tiny model's ops are too small to split, and on a loaded
    # 2-core machine two OpenMP threads wait on each other at every op (50x slower decoding measured)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = make_engine("hf", str(scripted.tiny_agent_checkpoint()), max_batch=8)
    yield eng
    eng.close()
    torch.set_num_threads(threads)


class Recorder:
    """Hooks on the engine: every (request, result) pair, and the pixel values the vision tower received."""

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.pixels = engine, [], []
        self.processor, self.path = engine.processor, engine.path
        self._hook = engine.model.model.visual.register_forward_pre_hook(
            lambda mod, args, kwargs: self.pixels.append(args[0].detach().clone()), with_kwargs=True)

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, req: GenRequest):
        res = await self.engine.generate(req)
        self.calls.append((req, res))
        return res

    def remove(self) -> None:
        self._hook.remove()


async def episodes(eng, n: int, store: dict) -> list:
    tools = scripted.agent_tools()
    client = build_env(tools=tools).client
    cfg = AgentConfig(max_turns=5, max_new_tokens=96, max_episode_tokens=2048, temperature=1.0)

    async def one(i: int):
        q, a = scripted.PLANS[i % len(scripted.PLANS)][:2]
        return await run_episode(eng, {"id": f"q{i}", "question": q, "answer": a},
                                 [scripted.picture(i % len(scripted.PLANS))], client, cfg,
                                 processor=eng.processor, tools=[t.schema for t in tools.values()], seed=i,
                                 group_id="g0", sample=i, image_store=store)

    return await asyncio.gather(*[one(i) for i in range(n)])


@pytest.fixture(scope="module")
def rollout(engine, tmp_path_factory):
    """N concurrent episodes, written to Parquet and read back; plus the engine-side record of each call."""
    rec = Recorder(engine)
    store: dict = {}
    try:
        trajs = asyncio.run(episodes(rec, N_EPISODES, store))
    finally:
        rec.remove()
    out = tmp_path_factory.mktemp("rollout")
    write_trajectories(out, trajs, store)
    return read_trajectories(out), out, rec


def test_policy_records_are_multi_turn_with_tool_images_and_batched(engine, rollout):
    trajs, _, rec = rollout
    good = [t for t in trajs if len(t.turns) >= 3 and len(t.images) >= 2]
    assert len(good) >= 4, [(len(t.turns), len(t.images), t.stop_reason) for t in trajs]
    assert len({len(t.input_ids) for t in good}) >= 4  # different lengths
    assert engine.stats["max_batch_seen"] >= 4  # turns of concurrent episodes went through one generate
    for t in trajs:
        assert t.kind == "policy" and len(t.logprobs) == len(t.input_ids)
        assert all(turn.policy_version == 0 for turn in t.turns)
        assert t.budgets["temperature"] == 1.0


def test_gen_mask_covers_exactly_the_engine_tokens(rollout):
    trajs, _, rec = rollout
    by_prompt: dict[tuple, list] = {}  # episodes of the same question share their first prompt
    for req, res in rec.calls:
        by_prompt.setdefault(tuple(req.prompt_ids), []).append(res)
    for t in trajs:
        runs, i = [], 0
        while i < len(t.gen_mask):  # maximal runs of model tokens
            if t.gen_mask[i]:
                j = i
                while j < len(t.gen_mask) and t.gen_mask[j]:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        assert len(runs) == len(t.turns)
        for turn, (s, e) in enumerate(runs):
            # the engine was given exactly the record's prefix and produced exactly the masked tokens, with
            # these log-probs (float32 storage); same-question episodes may share a prefix, so any one matches
            same = [r for r in by_prompt[tuple(t.input_ids[:s])] if r.token_ids == t.input_ids[s:e]]
            assert same, f"turn {turn} of {t.id}: no engine call produced these tokens from this prefix"
            assert min(np.abs(np.array(t.logprobs[s:e]) - np.array(r.logprobs)).max() for r in same) <= 1e-6
            assert set(t.step_ids[s:e]) == {turn}
        assert all(lp == 0.0 for lp, g in zip(t.logprobs, t.gen_mask, strict=True) if not g)


def _rescore(model, processor, trajs, image_dir) -> torch.Tensor:
    """Per-token log-probs of a right-padded batch of the stored records (training's view)."""
    from osvl.train.batch import collate, token_logprobs

    batch = collate(trajs, image_dir, processor, max_len=max(len(t.input_ids) for t in trajs), truncation="drop")
    with torch.no_grad():
        return token_logprobs(model, batch), batch["gen_mask"].bool(), batch["old_logprobs"]


def test_rescoring_the_stored_records_gives_the_behaviour_logprobs(engine, rollout):
    trajs, out, _ = rollout
    good = [t for t in trajs if len(t.turns) >= 3 and len(t.images) >= 2]
    logp, gen, old = _rescore(engine.model, engine.processor, good, out / "images")
    diff = (logp - old).abs()[gen]
    print(f"re-score over {int(gen.sum())} tokens of {len(good)} episodes: max {diff.max():.2e}, "
          f"mean {diff.mean():.2e}")
    assert diff.max() <= 1e-4


def test_pixels_rebuilt_for_training_equal_what_the_engine_saw(engine, tmp_path):
    engine.store.clear()  # the episode repeats one of the rollout's: nothing would be encoded again
    rec = Recorder(engine)
    store: dict = {}
    try:
        (traj,) = asyncio.run(episodes(rec, 1, store))
    finally:
        rec.remove()
    assert len(traj.images) >= 2, "the episode should crop a new image"
    write_trajectories(tmp_path, [traj], store)
    (back,) = read_trajectories(tmp_path)
    rebuilt = processor_inputs([load_image(tmp_path / "images", h) for h in back.images], back.image_max_pixels,
                               engine.processor)
    # with the prefix cache each image is encoded once, by the turn that first places it: together, in order,
    # the vision tower received every image of the episode
    assert torch.equal(torch.cat(rec.pixels), rebuilt["pixel_values"])


def test_prefix_cache_changes_nothing_but_the_work(engine):
    """Cached (prefix KV reused across turns and shared prompts) and uncached generation of the same seeded
    multi-turn episodes with a tool image: the same tokens, log-probs within 1e-5, far fewer tokens run."""
    plain = make_engine("hf", engine.path, max_batch=8, prefix_cache=False)
    before = dict(engine.stats)
    cached = asyncio.run(episodes(engine, 4, {}))
    uncached = asyncio.run(episodes(plain, 4, {}))
    assert any(len(t.turns) >= 3 and len(t.images) >= 2 for t in cached)
    for a, b in zip(cached, uncached, strict=True):
        assert a.input_ids == b.input_ids
        assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-5
    ran = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    reused = engine.stats["cached_tokens"] - before["cached_tokens"]
    assert plain.stats["cached_tokens"] == 0 and reused > 0
    assert ran * 4 < plain.stats["prefill_tokens"], (ran, reused)


def test_greedy_is_deterministic_and_weight_updates_change_it():
    eng = make_engine("hf", str(tiny_checkpoint("qwen3_vl")), max_batch=4)
    b = TrajectoryBuilder(eng.processor)
    b.add_image(scripted.picture(0))
    b.add_text("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>img_1\nWhat is it?<|im_end|>\n"
               "<|im_start|>assistant\n")
    req = GenRequest(b.input_ids, b.images, b.image_max_pixels, Sampling(temperature=0.0, max_new_tokens=12))

    async def twice():
        return await asyncio.gather(eng.generate(req), eng.generate(req))

    first, second = asyncio.run(twice())
    assert first.token_ids == second.token_ids and len(first.token_ids) >= 1
    sd = {k: v + 0.05 * torch.randn_like(v) for k, v in eng.model.state_dict().items() if "lm_head" in k
          or "embed_tokens" in k}
    assert eng.store.tokens() > 0 and first.version == 0
    eng.update_weights(sd, version=7)
    assert eng.store.tokens() == 0  # K/V of the old weights are gone
    after = asyncio.run(eng.generate(req))
    assert eng.version == 7 and after.version == 7 and after.token_ids != first.token_ids
    with pytest.raises(ConfigError):
        eng.update_weights({"no.such.weight": torch.zeros(1)}, version=8)
    eng.close()


def test_a_version_lands_between_steps_and_the_turn_keeps_its_oldest(engine):
    """An update does not wait for the turns in flight: it is applied between two decoding steps, the
    turn goes on with the new weights, and its result carries the version it started with (the oldest
    that sampled it). A stream of buckets is applied whole before any step runs again."""
    import threading
    import time

    ids = engine.tokenizer("The animal shown lives in")["input_ids"]
    req = GenRequest(list(ids), [], [], Sampling(temperature=0.0, max_new_tokens=200, stop_token_ids=[-1]))
    start = engine.version
    same = {k: v.clone() for k, v in engine.model.state_dict().items()}  # the same weights: outputs unchanged
    names = list(same)
    buckets = [{k: same[k] for k in names[: len(names) // 2]}, {k: same[k] for k in names[len(names) // 2:]}]
    steps_at: list[int] = []

    def update_mid_turn() -> None:
        while engine.stats["steps"] < steps0 + 5:  # the turn is decoding
            time.sleep(0.001)
        steps_at.append(engine.stats["steps"])
        engine.update_weights(iter(buckets), version=start + 1)
        steps_at.append(engine.stats["steps"])

    steps0 = engine.stats["steps"]
    t = threading.Thread(target=update_mid_turn)
    t.start()
    res = asyncio.run(engine.generate(req))
    t.join()
    assert len(res.token_ids) == 200  # the turn was not cut
    assert res.version == start and engine.version == start + 1
    assert steps_at[1] - steps_at[0] <= 2  # applied within a step or two of the request, not after the turn
    assert engine.stats["steps"] - steps0 > steps_at[1] - steps0  # decoding went on after the update


def test_a_cancelled_turn_is_aborted_before_the_next_step(engine):
    """A caller that goes away (a streaming client that disconnected) costs no more tokens: the engine drops
    its row at the next decoding step, while another turn in the same batch runs on."""
    import time

    ids = engine.tokenizer("The animal shown lives in")["input_ids"]
    sampling = Sampling(temperature=0.0, max_new_tokens=400, stop_token_ids=[-1])
    aborted0 = engine.stats["aborted"]

    async def go() -> tuple[int, object]:
        doomed = asyncio.ensure_future(engine.generate(GenRequest(list(ids), [], [], sampling)))
        other = asyncio.ensure_future(engine.generate(GenRequest(list(ids), [], [], Sampling(
            temperature=0.0, max_new_tokens=60, stop_token_ids=[-1]))))
        steps0 = engine.stats["steps"]
        while engine.stats["steps"] < steps0 + 5:
            await asyncio.sleep(0.001)
        doomed.cancel()
        steps_at_cancel = engine.stats["steps"]
        res = await other
        deadline = time.monotonic() + 10
        while engine.stats["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return steps_at_cancel, res

    steps_at_cancel, res = asyncio.run(go())
    assert len(res.token_ids) == 60  # the other turn ran to its end
    assert engine.stats["aborted"] == aborted0 + 1 and engine.stats["running"] == 0
    # the doomed turn would have run 400 steps; it stopped within a couple of steps of the cancel (the other
    # turn's 60 bound how long the engine kept stepping)
    assert engine.stats["steps"] - steps_at_cancel < 60


def test_a_tied_model_takes_the_state_dict_a_learner_sends(tmp_path):
    """A tied model's state dict names lm_head.weight, which its default parameter list leaves out: the update
    must take it (the rollout of a policy fine-tuned from jobs/pretrain_tiny.py waited forever on this)."""
    from osvl.models.load import load_model
    from osvl.models.pretrain import tie_and_scale

    base = tiny_checkpoint("qwen3_vl")
    model = load_model(base, dtype="float32", device="cpu")
    tie_and_scale(model, 5.0)
    shutil.copytree(base, tmp_path / "tied", dirs_exist_ok=True)
    model.save_pretrained(tmp_path / "tied")
    eng = make_engine("hf", str(tmp_path / "tied"), max_batch=2)
    sd = eng.model.state_dict()
    assert "lm_head.weight" in sd and "lm_head.weight" not in dict(eng.model.named_parameters())
    sd = {k: v + 1.0 for k, v in sd.items() if "embed_tokens" in k or "lm_head" in k}
    eng.update_weights(sd, version=3)
    assert eng.version == 3
    assert torch.equal(eng.model.get_output_embeddings().weight, sd["lm_head.weight"])
    eng.close()


def test_ask_job_prints_the_trajectory(capsys, tmp_path):
    import importlib.util
    import sys

    from osvl.config import REPO_ROOT

    spec = importlib.util.spec_from_file_location("ask_job", REPO_ROOT / "jobs" / "ask.py")
    ask = importlib.util.module_from_spec(spec)
    sys.modules["ask_job"] = ask  # dataclasses look their module up there
    spec.loader.exec_module(ask)
    image = REPO_ROOT / "osvl" / "kg" / "sample" / "images" / "categorization_monuments_eiffeltower.jpg"
    ask.main(["--image", str(image), "--question", scripted.PLANS[0][0], "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "--- turn 0 [tool_call" in out and ">>> crop(" in out and "new images: img_2" in out
    assert "stop reason: " in out and "tokens: " in out and "fatal: " in out
    (traj,) = read_trajectories(tmp_path)
    assert f"stop reason: {traj.stop_reason}" in out and traj.kind == "policy"
    assert traj.budgets["temperature"] == 0.0  # the demo profile answers greedily


def test_other_model_types_are_refused_with_the_engine_that_runs_them(tmp_path):
    """One generation path: the engine's own cached loop, for the model types whose positions it computes."""
    from osvl.agent.engines.hf import HFEngine

    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    with pytest.raises(ConfigError, match=r"'qwen2_5_vl': use the vLLM engine \(--engine vllm\)"):
        HFEngine(tmp_path)
