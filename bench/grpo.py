"""Asynchronous vs synchronous GRPO: learner steps/hour and trajectories/s at max_staleness 0 and 2.

Same CPUs (one rollout actor and one learner worker, 1 CPU each), same G, same
batch, a simulated 200 ms latency on every tool call (``rollout.tool_latency_s``),
the tiny agent checkpoint of ``osvl.agent.scripted`` on its own picture questions
(it really calls crop and text_search, so episodes have two tool turns). At max_staleness 0 the rollout actor idles
while the learner updates and the learner idles while the group is generated; at
2 the actor generates up to two steps ahead, so the two overlap. Rates are
measured between the first and the last step (start-up excluded).

    .venv/bin/python bench/grpo.py [--steps=N]

Last stdout line: JSON with ``ratio`` = steps/hour at max_staleness 2 over 0 (goal >= 1.5).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(staleness: int, steps: int, model: Path, qdir: Path, questions: list[dict], root: Path,
            schemas: Path) -> dict:
    from osvl.config import RunConfig
    from osvl.rl.learner import RLConfig
    from osvl.rl.rollout import RolloutConfig
    from osvl.rl.trainer import GRPOParts, LearnerConfig, TrainConfig, train

    parts = GRPOParts(
        run=RunConfig(seed=0), rl=RLConfig(group_size=4, lr=1e-4, beta=0.0, max_len=4096),
        rollout=RolloutConfig(num_actors=1, cpus_per_actor=1, groups_in_flight=4, max_turns=4, max_new_tokens=64,
                              max_episode_tokens=4096, tool_latency_s=0.2, offer=["crop", "text_search"],
                              schemas=str(schemas)),
        learner=LearnerConfig(num_workers=1, threads_per_worker=1, zero_stage=2),
        train=TrainConfig(steps=steps, groups_per_step=2, max_staleness=staleness, ckpt_every=10_000))
    res = train(parts, model, questions, qdir / "images", root / f"s{staleness}", log=lambda m: None)
    rows = res["rows"]
    span = rows[-1]["time"] - rows[0]["time"]
    n_traj = sum(r["trajectories"] for r in rows[1:])
    return {"max_staleness": staleness, "steps": len(rows), "steps_per_hour": 3600 * (len(rows) - 1) / span,
            "trajectories_per_s": n_traj / span, "staleness": rows[-1]["staleness"],
            "mean_wait_s": sum(r["wait_s"] for r in rows[1:]) / (len(rows) - 1),
            "mean_step_s": sum(r.get("step_s", 0.0) for r in rows[1:]) / (len(rows) - 1)}


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    from PIL import Image

    from osvl.agent.scripted import PLANS, agent_tools, picture, tiny_agent_checkpoint
    from osvl.cluster import init_ray
    from osvl.rl.trainer import read_questions

    steps = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--steps=")), 12)
    model = tiny_agent_checkpoint()
    init_ray(num_cpus=3)
    out = []
    with tempfile.TemporaryDirectory(prefix="osvl-bench-grpo-") as tmp:
        # the agent checkpoint's own questions, pictures and (short) tool descriptions: it calls
        # crop and text_search, each answered after the simulated 200 ms
        qdir = Path(tmp) / "questions"
        (qdir / "images").mkdir(parents=True)
        rows = []
        for i, (question, answer, *_) in enumerate(PLANS):
            Image.fromarray(picture(i)).save(qdir / "images" / f"pic{i}.png")
            rows.append({"id": f"q{i}", "question": question, "answer": answer, "answer_aliases": [],
                         "images": [f"pic{i}.png"], "path": [{"title": answer}]})
        pq.write_table(pa.Table.from_pylist(rows), qdir / "rl.parquet")
        schemas = qdir / "schemas.json"
        schemas.write_text(json.dumps([t.schema for t in agent_tools().values()]))
        questions = read_questions(qdir / "rl.parquet")
        for staleness in (0, 2):
            r = measure(staleness, steps, model, qdir, questions, Path(tmp), schemas)
            out.append(r)
            print(f"max_staleness {staleness}: {r['steps_per_hour']:.0f} learner steps/hour, "
                  f"{r['trajectories_per_s']:.2f} trajectories/s (learner waited {r['mean_wait_s']:.1f} s/step, "
                  f"updated {r['mean_step_s']:.1f} s/step; staleness {r['staleness']})", flush=True)
    ray.shutdown()
    ratio = out[1]["steps_per_hour"] / out[0]["steps_per_hour"]
    print(json.dumps({"ratio": round(ratio, 3), "sync": out[0], "async": out[1]}))


if __name__ == "__main__":
    main()
