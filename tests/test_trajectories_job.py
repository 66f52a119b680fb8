"""jobs/trajectories.py's library on a few sample questions: real Ray actors, real tools, the oracle teacher.

Checks the filters (every kept record judged correct with r_query over the bar, at most
``keep_per_question`` per question), the output layout, and resume: after a "crash" that
left one shard committed, the rerun runs only the other shard.
"""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest
from _questions import sample_questions

from osvl.agent.judge import answer_reward
from osvl.agent.trajectory import read_trajectories
from osvl.config import parse_args, run_dir
from osvl.expert.job import JOB, TrajConfig, run
from osvl.expert.rollouts import ShardWorker


@pytest.mark.slow
def test_trajectories_job_filters_writes_and_resumes(tmp_path, ray_cluster):
    qdir = sample_questions(str(tmp_path / "q"))
    cfg = parse_args(TrajConfig, JOB, [f"--run.root={tmp_path / 'runs'}", f"--questions={qdir}", "--max_questions=12",
                                       "--shard_size=6", "--workers=1", "--n_teacher_rollouts=2",
                                       "--keep_per_question=1", "--concurrency=8"])
    out = run_dir(cfg, JOB)
    # a first run that "died" after committing shard 0
    worker = ShardWorker(cfg, str(qdir), str(out))
    first = asyncio.run(worker.run_shard(0, worker.questions[:6]))
    marker = (out / "shards" / "shard-00000.json").read_text()
    logs: list[str] = []
    out2, rep = run(cfg, log=logs.append)
    assert out2 == out and "1 done, 1 to run" in logs[0]
    assert (out / "shards" / "shard-00000.json").read_text() == marker  # not redone

    rows = {r["id"]: r for r in pq.read_table(qdir / "sft.parquet").to_pylist()}
    trajs = read_trajectories(out)
    assert rep["kept"] == len(trajs) > 0 and rep["rollouts"] == 24 and rep["questions"] == 12
    assert rep["kept"] >= first["kept"]
    assert rep["degraded_restored_first"].split("/")[0] == rep["degraded_restored_first"].split("/")[1]
    per_q: dict[str, int] = {}
    for t in trajs:
        row = rows[t.question_id]
        assert t.kind == "teacher" and t.judge_status == "ok"
        assert t.r_acc == 1.0 == answer_reward(t.final_answer, row["answer"], row["answer_aliases"])
        assert t.r_query >= cfg.min_r_query and t.reward > 0
        assert all((out / "images" / f"{sha}.png").is_file() for sha in t.images)
        assert sum(t.gen_mask) > 0 and t.logprobs == []
        per_q[t.question_id] = per_q.get(t.question_id, 0) + 1
    assert max(per_q.values()) == 1
    dropped = rep["dropped"]
    assert dropped["dropped_answer"] + dropped["dropped_process"] + dropped["dropped_over_cap"] + rep["kept"] == 24
    assert json.loads((out / "report.json").read_text())["kept"] == rep["kept"]

    # a rerun of a finished run writes nothing new
    logs.clear()
    _, again = run(cfg, log=logs.append)
    assert "2 done, 0 to run" in logs[0] and again["kept"] == rep["kept"]
    assert len(read_trajectories(out)) == len(trajs)
