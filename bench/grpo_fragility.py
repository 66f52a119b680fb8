"""How many of the greedy policy's right answers survive GRPO updates (docs/design.md, "Why GRPO costs
greedy answers").

    .venv/bin/python bench/grpo_fragility.py [--groups=64] [--steps=20] [--every=5] [--section.key=value ...]

Held-out Pass@1 after 40 GRPO steps costs a whole job and moves by a few questions of 100; this
measures the mechanism behind it in minutes. It builds or reuses the questions and the SFT'd model
as ``jobs/grpo.py`` does (``osvl.recipe.grpo_inputs``; other flags are that job's, e.g. ``--rl.lr=3e-5``),
then, in this process:

1. samples G episodes at the rollouts' temperature on ``--groups`` RL questions (a seeded draw) and one
   greedy episode on each of the ``eval.n_heldout`` held-out questions, every one scored by the
   rollouts' reward (``osvl.agent.reward.score_trajectory``);
2. replays ``--steps`` learner updates of ``train.groups_per_step`` groups each, made exactly as the
   GRPO learner makes them (``rl_batch``, ``Learner.step`` on a one-rank DeepSpeed engine, the
   reference model when ``rl.beta`` > 0);
3. before the first update and after every ``--every`` updates, counts the greedy episodes that are
   *kept*: every generated token still the argmax of the updated policy. That is exactly what greedy
   decoding would reproduce, since the tools answer the same queries the same way; a right answer
   that is not kept is one that Pass@1 may lose.

The replay trains every step on samples of the starting policy, so from the second step on it is
off-policy by the number of steps (the importance ratio and its clip correct it, as with
``train.max_staleness``); it shows what updates of this size and signal do, not a run's exact path.
Baseline: the policy before any update. The last stdout line is JSON with ``ratio`` = right greedy
answers kept after the last update / right before (1.0 = the updates cost no answer), beside the
wrong ones kept, the right answers' close calls (tokens won by < 0.5 logits), the samples' r_acc,
the groups with an r_acc signal and each measured step's KL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from osvl.agent.env import build_env  # noqa: E402
from osvl.agent.loop import run_episode  # noqa: E402
from osvl.agent.reward import score_trajectory  # noqa: E402
from osvl.agent.trajectory import png_bytes, question_images  # noqa: E402
from osvl.cluster import init_ray  # noqa: E402
from osvl.config import parse_args, script_flags  # noqa: E402
from osvl.models.load import load_model, load_processor  # noqa: E402
from osvl.recipe import GRPOJobConfig, grpo_inputs  # noqa: E402
from osvl.rl.job import JOB  # noqa: E402
from osvl.rl.learner import Learner, forward_logprobs, learner_ds_config, make_engine, scored_positions  # noqa: E402
from osvl.rl.learner_loop import rank_share, reference_model, rl_batch  # noqa: E402
from osvl.rl.trainer import heldout_questions, read_questions  # noqa: E402
from osvl.tools.registry import offered_tools  # noqa: E402


def episodes(cfg: Any, model: Path, qdir: Path, rl_rows: list[dict], held_rows: list[dict], image_dir: Path,
             seed: int) -> tuple[list[list[Any]], list[Any]]:
    """G sampled episodes per RL row and one greedy episode per held-out row, scored; their images saved."""
    rc, G = cfg.rollout, cfg.rl.group_size
    image_dir.mkdir(parents=True, exist_ok=True)

    async def go() -> tuple[list[list[Any]], list[Any]]:
        # the rollouts' engine and search engine (the one the SFT records show), tools in this process
        env = build_env(model=str(model), engine=rc.engine, max_batch=rc.max_batch, text_search=rc.text_search)
        engine, client, tools = env.engine, env.client, offered_tools(rc.offer, rc.schemas)
        sem = asyncio.Semaphore(cfg.eval.concurrency)

        async def one(row: dict, agent: Any, s: int, gid: str, i: int) -> Any:
            async with sem:
                store: dict = {}
                tr = await run_episode(engine, row, question_images(qdir / "images", row), client, agent,
                                       processor=engine.processor, tools=tools, seed=s, group_id=gid, sample=i,
                                       image_store=store)
                for sha in tr.images:
                    if not (image_dir / f"{sha}.png").exists():
                        (image_dir / f"{sha}.png").write_bytes(png_bytes(store[sha]))
                return await score_trajectory(tr, row, rc.reward)

        try:
            sampled = rc.episode_agent()
            groups = await asyncio.gather(*(asyncio.gather(*(one(row, sampled, seed + 1000 * k + i, f"g{k}", i)
                                                             for i in range(G))) for k, row in enumerate(rl_rows)))
            greedy = rc.episode_agent(greedy=True)
            held = await asyncio.gather(*(one(row, greedy, 0, f"h{k}", 0) for k, row in enumerate(held_rows)))
        finally:
            await env.aclose()
        return [list(g) for g in groups], list(held)

    return asyncio.run(go())


def kept_and_margins(model: torch.nn.Module, trajs: list[Any], image_dir: Path, processor: Any, cfg: Any,
                     temperature: float) -> tuple[list[bool], list[int]]:
    """Per trajectory: whether every generated token is still the argmax, and how many win by < 0.5 logits."""
    kept, close = [], []
    was = model.training
    model.eval()
    with torch.no_grad():
        for tr in trajs:
            b = rl_batch([[tr]], str(image_dir), processor, cfg.rl)
            _, logits = forward_logprobs(model, b, temperature)
            target = b["input_ids"][scored_positions(b["gen_mask"])]
            top2 = logits.topk(2, dim=-1)
            chosen = logits.gather(-1, target[:, None])[:, 0]
            rival = torch.where(top2.indices[:, 0] == target, top2.values[:, 1], top2.values[:, 0])
            margin = (chosen - rival) * temperature  # in logits of the untempered policy
            kept.append(bool((margin > 0).all()))
            close.append(int((margin < 0.5).sum()))
    model.train(was)
    return kept, close


def main() -> None:
    flag, job_args = script_flags(sys.argv[1:], {"groups": 64, "steps": 20, "every": 5}, rest=True)
    n_groups, steps, every = flag["groups"], flag["steps"], flag["every"]
    cfg = parse_args(GRPOJobConfig, JOB, job_args)
    cfg.rollout.check()
    init_ray(num_cpus=3)
    qdir, model_dir = grpo_inputs(cfg, log=lambda m: print(m, flush=True))
    rl_all = sorted(read_questions(qdir / "rl.parquet"), key=lambda r: r["id"])
    pick = np.random.default_rng(cfg.run.seed).permutation(len(rl_all))[:n_groups]
    rl_rows = [rl_all[int(i)] for i in pick]
    held_rows = heldout_questions(qdir / "heldout.parquet", cfg.eval.n_heldout)
    tmp = tempfile.TemporaryDirectory(prefix="osvl-bench-fragility-")
    image_dir = Path(tmp.name) / "images"  # the episodes' images, where rl_batch reads them
    t0 = time.perf_counter()
    groups, held = episodes(cfg, Path(model_dir), qdir, rl_rows, held_rows, image_dir, cfg.run.seed)
    gen_s = time.perf_counter() - t0
    samples = [t for g in groups for t in g]
    signal = sum(len({t.r_acc for t in g}) > 1 for g in groups)
    right = [t for t in held if t.r_acc > 0 and len(t.input_ids) <= cfg.rl.max_len]
    wrong = [t for t in held if t.r_acc == 0 and len(t.input_ids) <= cfg.rl.max_len]
    r_acc = float(np.mean([t.r_acc for t in samples]))
    print(f"{len(samples)} samples on {len(groups)} RL questions in {gen_s:.0f} s: r_acc {r_acc:.3f}, "
          f"{signal} groups with an r_acc signal; greedy held-out: {len(right)} right, {len(wrong)} wrong", flush=True)

    torch.manual_seed(cfg.run.seed)
    temperature = cfg.rollout.agent.temperature
    processor = load_processor(model_dir)
    ref = reference_model(model_dir, cfg.rl, learner_ds_config(cfg.rl))  # ZeRO-2, fp32: the one-worker CPU job's
    learner = Learner(make_engine(load_model(model_dir, dtype="float32"), cfg.rl), cfg.rl, ref_model=ref,
                      temperature=temperature)
    rows = []

    def measure(step: int, kl: float) -> None:
        rk, close = kept_and_margins(learner.model, right, image_dir, processor, cfg, temperature)
        wk, _ = kept_and_margins(learner.model, wrong, image_dir, processor, cfg, temperature)
        rows.append({"step": step, "right_kept": sum(rk), "wrong_kept": sum(wk), "kl": kl,
                     "right_with_close_calls": sum(c > 0 for c in close)})
        print(f"  after {step:3d} updates: right kept {sum(rk)}/{len(right)}, wrong kept {sum(wk)}/{len(wrong)}, "
              f"KL {kl:.4f}", flush=True)

    measure(0, 0.0)
    gps = cfg.train.groups_per_step
    for s in range(steps):
        chunk = groups[s * gps:(s + 1) * gps]
        if not chunk:
            break
        share = rank_share(chunk, 0, 1, cfg.rl)  # the micro-batches a one-worker job's learner trains
        if share is None:
            continue
        res = learner.step([(rl_batch(c, str(image_dir), processor, cfg.rl), live) for c, live in share])
        if (s + 1) % every == 0 or s + 1 == steps:
            measure(s + 1, res.kl)
    first, last = rows[0], rows[-1]
    ratio = last["right_kept"] / first["right_kept"] if first["right_kept"] else None
    print(json.dumps({"ratio": ratio, "lr": cfg.rl.lr, "mode": cfg.rl.mode, "steps": last["step"],
                      "groups_per_step": gps, "group_size": cfg.rl.group_size, "samples": len(samples),
                      "sample_r_acc": r_acc, "groups_with_signal": signal,
                      "right": len(right), "wrong": len(wrong), "rows": rows,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    tmp.cleanup()


if __name__ == "__main__":
    main()
