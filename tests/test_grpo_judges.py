"""LLM judges in GRPO, for real: local Ray, the rollout actors, the Ray Train + DeepSpeed learner, and a judge
served over HTTP on 127.0.0.1.

1. One GRPO step whose reward asks an LLM for r_acc and r_query: the questions' reference answers are wrong
   on purpose, so the rule judge would give r_acc 0 everywhere; the stub judge says "correct: yes" to every
   answer and "score: 7" to every search, and the step's r_acc and r_query are what it said.
2. The same step with the judge's address unreachable: every group is dropped with reason ``judge_failed``
   in the ledger (and counted in the buffer's stats), nothing is trained, nothing is scored 0.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from osvl.agent.loop import AgentConfig
from osvl.agent.reward import RewardConfig
from osvl.cluster import LOOPBACK, free_port
from osvl.config import RunConfig
from osvl.endpoint import EndpointConfig
from osvl.rl.job import JOB
from osvl.rl.learner import RLConfig
from osvl.rl.rollout import RolloutConfig
from osvl.rl.trainer import GRPOParts, LearnerConfig, TrainConfig, read_questions, train

pytestmark = pytest.mark.slow

WRONG = "Zzyzx Nowhere"  # every question's reference answer: no answer of the agent matches it by rule


@pytest.fixture(scope="module")
def questions_dir(tmp_path_factory) -> Path:
    """The scripted agent's picture questions (it answers them), with a reference answer it never gives."""
    from osvl.agent.scripted import question_folder

    return question_folder(tmp_path_factory.mktemp("questions"), answer=WRONG)


@pytest.fixture(scope="module")
def agent_model() -> Path:
    from osvl.agent.scripted import tiny_agent_checkpoint

    return tiny_agent_checkpoint()


@pytest.fixture()
def judge_url():
    """An OpenAI chat-completions stub on loopback that calls every answer correct and every search a 7."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][-1]["content"]
            asked.append(text)
            reply = "score: 7" if "score: N" in text else "correct: yes"
            data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}/v1", asked
    server.shutdown()
    server.server_close()


def _parts(base_url: str, schemas: Path) -> GRPOParts:
    reward = RewardConfig(judge="llm", query_scorer="llm")
    judge = EndpointConfig(base_url=base_url, model="stub-judge", retries=1, backoff_s=0.01, timeout_s=10)
    rollout = RolloutConfig(workers=1, cpus_per_worker=1, groups_in_flight=2, offer=["crop", "text_search"],
                            schemas=str(schemas), reward=reward, judge=judge,
                            agent=AgentConfig(max_turns=3, max_new_tokens=64, max_episode_tokens=2048))
    return GRPOParts(run=RunConfig(seed=1), rl=RLConfig(group_size=2, lr=1e-4, beta=0.0), rollout=rollout,
                     learner=LearnerConfig(), train=TrainConfig(steps=1, groups_per_step=2, ckpt_every=100))


def _train(parts: GRPOParts, model: Path, qdir: Path, out: Path) -> dict:
    return train(parts, model, read_questions(qdir / "rl.parquet"), qdir / "images", out, log=lambda m: None, job=JOB)


def test_grpo_step_takes_r_acc_and_r_query_from_the_llm_judge(questions_dir, agent_model, judge_url, tmp_path,
                                                              ray_cluster):
    url, asked = judge_url
    res = _train(_parts(url, questions_dir / "schemas.json"), agent_model, questions_dir, tmp_path)
    [row] = res["rows"]
    assert row["groups"] == 2 and row["trajectories"] == 4 and res["buffer"]["dropped"] == 0
    answers = [t for t in asked if "Candidate answer:" in t]
    assert answers and all(f"Reference answer: {WRONG}" in t for t in answers)  # the rule would have said 0
    # every episode that answered was judged correct by the stub: r_acc is the share that answered
    assert row["r_acc"] > 0
    assert row["r_query"] == pytest.approx(0.7)  # the stub's "score: 7" for every trajectory, fatal ones too


def test_grpo_drops_a_group_whose_judge_is_unreachable(questions_dir, agent_model, tmp_path, ray_cluster):
    dead = f"http://{LOOPBACK}:{free_port()}/v1"  # nothing listens there
    res = _train(_parts(dead, questions_dir / "schemas.json"), agent_model, questions_dir, tmp_path)
    ledger = res["ledger"]
    assert len(ledger) == 2 and res["buffer"]["consumed"] == 0
    for g, v in ledger.items():
        # the reason names the endpoint that failed and why (here: nothing accepts the connection)
        assert v["state"] == "dropped" and v["reason"].startswith(
            f"judge_failed: 2 of 2 samples could not be judged ({dead}/chat/completions: no answer after "), (g, v)
        assert "Cannot connect to host" in v["reason"], v
    assert res["buffer"]["dropped_by_reason"] == {"judge_failed": 2}
    [row] = res["rows"]
    assert row["groups"] == 0 and row["trajectories"] == 0  # the step trained nothing; no made-up zero
