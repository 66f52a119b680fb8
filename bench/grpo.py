"""Asynchronous vs synchronous GRPO: learner steps/hour and trajectories/s at max_staleness 0 and 2.

Same CPUs (one rollout actor and one learner worker, 1 CPU and 1 torch thread each),
same G, same batch, a simulated 200 ms latency on every tool call
(``rollout.tool_latency_s``), the tiny agent checkpoint of ``osvl.agent.scripted`` on
its own picture questions (it really calls crop and text_search, so episodes have two
tool turns). This is osvl's real actor-learner (``osvl.rl.trainer.train``): buffer,
rollout actor, Ray Train learner with DeepSpeed, weight store. At max_staleness 0 the
rollout actor idles while the learner updates and the learner idles while the group
is generated; at 2 the actor generates up to two steps ahead, so the two overlap and
a step costs max(generation, update) instead of their sum. Rates are measured between
the first and the last step (start-up excluded).

Reading the figures on a shared machine. The overlap needs a second core. Linux
groups a session's processes into one scheduling entity (``sched_autogroup``), so
when other sessions keep the cores busy this run's whole process tree gets about one
core's share however many of its processes are runnable: the async run then cannot
use more CPU than the sync one, and its gain shrinks to the waits it hides (tool
latency, RPCs). So every mode reports ``cores``, the CPU-seconds this run's processes
(driver, actors, learner, Ray) used per wall-second over the measured window, and the
machine's load; the learner's CPU-seconds per step (``learner_cpu_s``) against its
wall time (``learner_s``) shows the same from the inside. On an idle 2-core machine
``cores`` approaches 2 at max_staleness 2.

    .venv/bin/python bench/grpo.py [--steps=N]

Last stdout line: JSON with ``ratio`` = steps/hour at max_staleness 2 over 0 (goal >= 1.5).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.agent.loop import AgentConfig  # noqa: E402
from osvl.agent.scripted import question_folder, tiny_agent_checkpoint  # noqa: E402
from osvl.cluster import init_ray  # noqa: E402
from osvl.config import RunConfig, script_flags  # noqa: E402
from osvl.rl.job import JOB  # noqa: E402
from osvl.rl.learner import RLConfig  # noqa: E402
from osvl.rl.rollout import RolloutConfig  # noqa: E402
from osvl.rl.trainer import GRPOParts, LearnerConfig, TrainConfig, read_questions, train  # noqa: E402


class CpuMeter(threading.Thread):
    """CPU-seconds used by this process and every process it started (the local Ray cluster), sampled each second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []  # (unix time, CPU-seconds so far)
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            total = 0.0
            for p in [me, *me.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass  # exited between listing and reading
            self.samples.append((time.time(), total))
            self.stop.wait(1.0)

    def cores(self, t0: float, t1: float) -> float:
        """Mean cores used between unix times t0 and t1 (nearest samples)."""
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        return (b[1] - a[1]) / max(b[0] - a[0], 1e-9)


def measure(staleness: int, steps: int, model: Path, qdir: Path, questions: list[dict], root: Path,
            schemas: Path, meter: CpuMeter) -> dict:
    parts = GRPOParts(
        run=RunConfig(seed=0), rl=RLConfig(group_size=4, lr=1e-4, beta=0.0, max_len=4096),
        rollout=RolloutConfig(workers=1, cpus_per_worker=1, groups_in_flight=4, tool_latency_s=0.2,
                              offer=["crop", "text_search"], schemas=str(schemas),
                              agent=AgentConfig(max_turns=4, max_new_tokens=64, max_episode_tokens=4096)),
        learner=LearnerConfig(workers=1, threads_per_worker=1, zero_stage=2),
        train=TrainConfig(steps=steps, groups_per_step=2, max_staleness=staleness, ckpt_every=10_000))
    res = train(parts, model, questions, qdir / "images", root / f"s{staleness}", log=lambda m: None, job=JOB)
    rows = res["rows"]
    t0, t1 = rows[0]["time"], rows[-1]["time"]
    span = t1 - t0
    n = len(rows) - 1
    return {"max_staleness": staleness, "steps": len(rows), "steps_per_hour": 3600 * n / span,
            "trajectories_per_s": sum(r["trajectories"] for r in rows[1:]) / span,
            "staleness": rows[-1]["staleness"], "mean_wait_s": sum(r["wait_s"] for r in rows[1:]) / n,
            "learner_s": sum(r.get("step_s", 0.0) for r in rows[1:]) / n,
            "learner_cpu_s": sum(r.get("step_cpu_s", 0.0) for r in rows[1:]) / n,
            "cores": meter.cores(t0, t1), "load": os.getloadavg()[0]}


def main() -> None:
    steps = script_flags(sys.argv[1:], {"steps": 12})[0]["steps"]
    model = tiny_agent_checkpoint()
    meter = CpuMeter()
    meter.start()
    init_ray(num_cpus=3)
    out = []
    with tempfile.TemporaryDirectory(prefix="osvl-bench-grpo-") as tmp:
        # the agent checkpoint's own questions, pictures and (short) tool descriptions: it calls
        # crop and text_search, each answered after the simulated 200 ms
        qdir = Path(tmp) / "questions"
        schemas = question_folder(qdir) / "schemas.json"
        questions = read_questions(qdir / "rl.parquet")
        for staleness in (0, 2):
            r = measure(staleness, steps, model, qdir, questions, Path(tmp), schemas, meter)
            out.append(r)
            print(f"max_staleness {staleness}: {r['steps_per_hour']:.0f} learner steps/hour, "
                  f"{r['trajectories_per_s']:.2f} trajectories/s (learner waited {r['mean_wait_s']:.1f} s/step, "
                  f"updated {r['learner_s']:.1f} s/step using {r['learner_cpu_s']:.1f} CPU-s; this run used "
                  f"{r['cores']:.2f} cores, machine load {r['load']:.1f}; staleness {r['staleness']})", flush=True)
    ray.shutdown()
    meter.stop.set()
    ratio = out[1]["steps_per_hour"] / out[0]["steps_per_hour"]
    print(json.dumps({"ratio": round(ratio, 3), "sync": out[0], "async": out[1]}))


if __name__ == "__main__":
    main()
