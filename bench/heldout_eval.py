"""Held-out Pass@1 scoring (``osvl.rl.rollout.heldout_scores``) in one Ray task vs split over two.

The GRPO job scores its held-out questions before and after training, when no rollout actor or
learner worker holds the machine. One task runs one CPU engine thread (Ray gives a 1-CPU task one
OpenMP thread), so on the demo's 2-core machine half of it idles; ``eval.workers`` tasks each take
a contiguous share of the questions and their scores come back in question order.

What runs is the job's own function on a local Ray cluster: the tiny agent checkpoint
(``osvl.agent.scripted``, multi-turn: crop, text_search, answer) on its picture questions, each
repeated ``--repeat`` times under its own id, greedy, agentic and direct modes as the job scores.
Both variants score the same questions; their scores must agree.

    .venv/bin/python bench/heldout_eval.py [--repeat=24] [--workers=2]

Last stdout line: JSON with both wall times (model load and Ray task start included, as the job
pays them) and ``ratio`` = one task's wall time over ``--workers`` tasks'.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.agent.loop import AgentConfig  # noqa: E402
from osvl.agent.scripted import question_folder, tiny_agent_checkpoint  # noqa: E402
from osvl.cluster import init_ray  # noqa: E402
from osvl.config import script_flags  # noqa: E402
from osvl.rl.rollout import RolloutConfig, heldout_scores  # noqa: E402


def main() -> None:
    flag, _ = script_flags(sys.argv[1:], {"repeat": 24, "workers": 2})
    model = tiny_agent_checkpoint()
    init_ray(num_cpus=flag["workers"])
    with tempfile.TemporaryDirectory(prefix="osvl-bench-heldout-") as tmp:
        qdir = question_folder(Path(tmp))
        base = pq.read_table(qdir / "heldout.parquet").to_pylist()
        rows = [{**row, "id": f"{row['id']}-{k}"} for k in range(flag["repeat"]) for row in base]
        cfg = RolloutConfig(offer=["crop", "text_search"], schemas=str(qdir / "schemas.json"),
                            agent=AgentConfig(max_turns=3, max_new_tokens=64, max_episode_tokens=2048))
        walls, scores = {}, {}
        for workers in (1, flag["workers"]):
            t0 = time.perf_counter()
            scores[workers] = heldout_scores(model, rows, qdir / "images", cfg, modes=("agentic", "direct"),
                                             workers=workers)
            walls[workers] = time.perf_counter() - t0
            print(f"  workers={workers}: {len(rows)} questions in {walls[workers]:.1f} s, agentic Pass@1 "
                  f"{sum(scores[workers]['agentic']) / len(rows):.3f}", flush=True)
    print(json.dumps({"ratio": round(walls[1] / walls[flag["workers"]], 3), "one_task_s": round(walls[1], 2),
                      "split_s": round(walls[flag["workers"]], 2), "workers": flag["workers"],
                      "questions": len(rows), "same_scores": scores[1] == scores[flag["workers"]]}))


if __name__ == "__main__":
    main()
