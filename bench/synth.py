"""Synthesis scaling: questions/s with 1 and with 2 Ray Data workers at one thread each.

``python bench/synth.py [--kg_dir=DIR] [--questions_per_seed=N]``: runs the same
synthesis twice on one local Ray cluster (2 CPUs), into fresh temporary run roots (so
nothing is resumed), once per worker count, and prints one JSON object last with
``ratio`` = (questions/s with 2 workers) / (questions/s with 1 worker): data-parallel
scaling, 2.0 being perfect. Every worker is held to one thread (OpenMP, BLAS and
OpenCV's pool, which the degradation step would otherwise spread over both cores), so
the 1-worker baseline cannot borrow the second core and the ratio measures workers, not
threads. The time covers the whole job (graph loads in the actors, every shard,
finalize), which is what a user waits for.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.cluster import init_ray  # noqa: E402
from osvl.config import apply_override  # noqa: E402
from osvl.synth.job import SynthConfig, run  # noqa: E402


def main(argv: list[str]) -> None:
    cfg = SynthConfig()  # the demo defaults: the committed sample, 16 shards
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        cfg = apply_override(cfg, key, value)
    one_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                    "OPENCV_FOR_THREADS_NUM")}
    init_ray(num_cpus=2, runtime_env={"env_vars": one_thread})
    result = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as root:
            c = apply_override(apply_override(cfg, "workers", str(workers)), "run.root", root)
            t0 = time.perf_counter()
            _, card = run(c, log=lambda _msg: None)
            seconds = time.perf_counter() - t0
        result[f"workers_{workers}"] = {"questions": card["questions"], "seconds": round(seconds, 2),
                                        "questions_per_s": round(card["questions"] / seconds, 2)}
        print(f"{workers} worker(s): {card['questions']} questions in {seconds:.1f} s", flush=True)
    result["threads_per_worker"] = 1
    result["ratio"] = round(result["workers_2"]["questions_per_s"] / result["workers_1"]["questions_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
