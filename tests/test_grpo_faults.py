"""GRPO under faults, for real (local Ray, Ray Train + DeepSpeed learner, HF engine, in-process tools).

1. A rollout actor killed while its groups are in flight: every issued group id is consumed by exactly
   one learner step or logged as dropped with a reason, and the killed actor's groups are re-issued.
2. The job SIGKILLed after a checkpoint and rerun: step count, policy version, data cursor, weights and
   Adam moments continue exactly from what the checkpoint holds.
3. Weights a rollout actor cannot apply end its run with the reason, not in a wait that never ends.

The resume test's policy is the tiny agent checkpoint of ``osvl.agent.scripted`` (it calls crop and
text_search, then answers), so rewards differ within a group and the Adam moments are not zero.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from osvl.agent.loop import AgentConfig
from osvl.config import RunConfig
from osvl.rl.job import JOB
from osvl.rl.learner import RLConfig
from osvl.rl.rollout import RolloutConfig
from osvl.rl.trainer import GRPOParts, LearnerConfig, TrainConfig, read_questions, train

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def questions_dir(tmp_path_factory) -> Path:
    """A synthesize-shaped folder (rl/heldout.parquet + images/ + schemas.json) with the agent's own picture
    questions."""
    from osvl.agent.scripted import question_folder

    return question_folder(tmp_path_factory.mktemp("questions"))


@pytest.fixture(scope="module")
def agent_model() -> Path:
    from osvl.agent.scripted import tiny_agent_checkpoint

    return tiny_agent_checkpoint()


ROLLOUT = dict(workers=1, cpus_per_worker=1, groups_in_flight=2, offer=["crop", "text_search"],
               agent=AgentConfig(max_turns=3, max_new_tokens=48, max_episode_tokens=2048))


def test_killed_rollout_actor_groups_are_reissued_and_accounted_once(questions_dir, tmp_path, ray_cluster):
    """Accounting only, so the random tiny model is enough (its episodes end after K invalid turns)."""
    import ray

    from osvl.models.tiny import tiny_checkpoint

    parts = GRPOParts(run=RunConfig(seed=1), rl=RLConfig(group_size=2, lr=1e-4, beta=0.0),
                      rollout=RolloutConfig(**ROLLOUT), learner=LearnerConfig(),
                      train=TrainConfig(steps=3, groups_per_step=2, max_staleness=1, ckpt_every=100))
    prefix = f"faults-{os.getpid()}-"
    result: dict = {}
    run = threading.Thread(target=lambda: result.update(train(
        parts, tiny_checkpoint("qwen3_vl"), read_questions(questions_dir / "rl.parquet"), questions_dir / "images",
        tmp_path,
        log=lambda m: None, actor_prefix=prefix, job=JOB)))
    run.start()
    killed = False
    deadline = time.time() + 240
    while time.time() < deadline and run.is_alive() and not killed:
        try:
            ledger = ray.get(ray.get_actor(prefix + "buffer").ledger.remote())
        except ValueError:  # not created yet
            time.sleep(0.5)
            continue
        mine = [g for g, v in ledger.items() if v["state"] == "issued" and v["actor"] == "rollout0"]
        if mine and any(v["state"] == "consumed" for v in ledger.values()):  # mid-run, groups in flight
            ray.kill(ray.get_actor(prefix + "rollout0"))
            killed = True
        else:
            time.sleep(0.2)
    run.join(300)
    assert killed, "no moment with groups in flight was seen"
    assert not run.is_alive() and result, "the run did not finish after the kill"

    ledger, rows = result["ledger"], result["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert result["restarts"] and result["restarts"][0].startswith("rollout0 -> rollout0~1")
    reissued = {e.split()[1] for e in result["events"] if e.startswith("reissue")}
    assert reissued, result["events"]
    # exactly once: every issued id is consumed by one step's batch or dropped with a reason
    trained = [g for r in rows for g in r["group_ids"]]
    assert len(trained) == len(set(trained))
    assert set(trained) == {g for g, v in ledger.items() if v["state"] == "consumed"}
    for g, v in ledger.items():
        assert v["state"] in ("consumed", "dropped"), (g, v)
        assert v["state"] != "dropped" or v["reason"], (g, v)
    assert len(ledger) == 6  # 3 steps x 2 groups, none issued twice under another id
    # versions went over the weight group (the default transport), the replacement caught up from the object
    # store and then joined a rebuilt group, and every live engine holds the learner's last version bit for bit
    sent = rows[-1]["weights"]
    assert sent["rebuilds"] >= 2 and sent["sha256"], sent
    (new,) = [a for a in result["actors"] if a["alive"]]
    assert new["actor"] == "rollout0~1" and new["weights_sha256"] == sent["sha256"], (new, sent)
    assert new["weights"]["versions_stored"] >= 1 and new["weights"]["versions_group"] >= 1, new["weights"]
    # the last step is a checkpoint: the training curves (reward parts, fatal rate, clamp split, KL,
    # entropy) are drawn into the run folder
    from PIL import Image

    with Image.open(tmp_path / "curves.png") as im:
        assert im.format == "PNG" and im.width > 600 and im.height > 400
    for g in reissued:
        assert ledger[g]["attempt"] >= 1 and ledger[g]["actor"].startswith("rollout0~"), (g, ledger[g])
    # the learner's rank 0 logged every numeric field of each step row to TensorBoard (osvl/tracking.py) as well
    from osvl.tracking import read_scalars

    tb = read_scalars(tmp_path)
    for name in ("reward", "fatal_rate", "r_acc", "buffer_ready", "weights/rebuilds"):
        assert [s for s, _ in tb[name]] == [1, 2, 3], (name, tb.get(name))
    for name in ("reward", "fatal_rate"):
        assert [v for _, v in tb[name]] == pytest.approx([r[name] for r in rows], rel=1e-6, abs=1e-7)
    assert "versions" not in tb and "step" not in tb


def test_rollout_actor_fails_when_a_weight_update_cannot_be_applied(questions_dir, ray_cluster):
    """Published weights the engine refuses (here a name the model does not have; once, a tied model's
    lm_head.weight) end the actor's run with the reason, instead of leaving its groups waiting for a
    version that never arrives (a GRPO run once hung so)."""
    import ray
    import torch

    from osvl.models.tiny import tiny_checkpoint
    from osvl.rl.buffer import TrajectoryBuffer
    from osvl.rl.rollout import RolloutWorker
    from osvl.rl.weights import WeightStore

    buffer = ray.remote(TrajectoryBuffer).options(num_cpus=0).remote(2, 1, 2, 1, 0, 3)
    store = ray.remote(WeightStore).options(num_cpus=0).remote()
    actor = ray.remote(RolloutWorker).options(num_cpus=1, max_restarts=0).remote(
        "rollout0", RolloutConfig(**ROLLOUT), str(tiny_checkpoint("qwen3_vl")),
        read_questions(questions_dir / "rl.parquet"), str(questions_dir / "images"),
        str(questions_dir / "work_images"), buffer, store, 2)
    try:
        # the object store's version (the catch-up path): one bucket of one tensor
        ray.get(store.publish.remote(0, [[("no_such.weight", (3,))]], "float32", [[ray.put(torch.zeros(3))]]))
        with pytest.raises(ray.exceptions.RayTaskError, match="weight sync failed.*no_such.weight"):
            ray.get(actor.run.remote(), timeout=120)  # a hang would end in GetTimeoutError instead
    finally:
        for a in (actor, buffer, store):
            ray.kill(a)


# The tiny agent often draws groups of equal rewards (all 0), whose advantages and so gradients are 0: the
# job checkpoints every step and is killed after the first checkpoint that holds non-zero Adam moments, so
# the probe can show real moments were restored (with a fixed kill step a fresh clone once saw only zeros).
STEPS = 12


def _moved(ckpt: Path) -> bool:
    probe = ckpt / "probe.json"
    return probe.is_file() and json.loads(probe.read_text())["exp_avg_abs_sum"] > 0


def _job(questions_dir: Path, model: Path, root: Path) -> list[str]:
    return [sys.executable, str(REPO / "jobs" / "grpo.py"), f"--run.root={root}", "--run.name=resume",
            f"--questions={questions_dir}", f"--model={model}", "--eval.n_heldout=0", "--rl.group_size=4",
            "--rl.lr=1e-4", "--rl.beta=0.001", f"--train.steps={STEPS}", "--train.groups_per_step=2",
            "--train.max_staleness=1", "--train.ckpt_every=1", f"--train.keep={STEPS}", "--rollout.groups_in_flight=2",
            "--rollout.agent.max_turns=3", "--rollout.agent.max_new_tokens=64",
            "--rollout.agent.max_episode_tokens=2048",
            "--rollout.offer=crop,text_search", f"--rollout.schemas={questions_dir / 'schemas.json'}"]


def test_job_killed_after_checkpoint_resumes_exactly(questions_dir, agent_model, tmp_path):
    cmd = _job(questions_dir, agent_model, tmp_path)
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own local cluster, as a user's rerun would get
    out = tmp_path / "grpo" / "resume"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None and not any(
                _moved(c) for c in (out / "checkpoints").glob("step_*")):
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its first checkpoint"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(2)
    ckpt = max(p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    saved_step = int(ckpt.name.split("_")[1])
    assert saved_step < STEPS
    saved_probe = json.loads((ckpt / "probe.json").read_text())
    saved_buffer = pickle.loads((ckpt / "buffer.pkl").read_bytes())

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming from {ckpt.name}" in done.stdout
    # weights and Adam moments right after loading are bit-identical to what was saved
    resumed_probe = json.loads((out / "checkpoints" / "resume_probe.json").read_text())
    assert resumed_probe == saved_probe
    assert saved_probe["exp_avg_abs_sum"] > 0  # real Adam moments, not an untouched optimizer
    assert saved_probe["step"] == saved_step  # the policy version continues from the checkpoint
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == ckpt.name
    rows = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    after = [r["step"] for r in rows][-(STEPS - saved_step):]
    assert after == list(range(saved_step + 1, STEPS + 1))  # the step count continues to the end
    # the data cursor continues: slots consumed before the checkpoint are not trained again, and the
    # resumed steps train the slots that follow, with the same questions the cursor assigns
    before = {f"g{n}" for n, s in saved_buffer["slots"].items() if s["state"] == "consumed"}
    trained_after = [g for r in rows[-(STEPS - saved_step):] for g in r["group_ids"]]
    assert not before & set(trained_after)
    assert {int(g[1:]) // 2 for g in trained_after} <= set(range(saved_step, STEPS))
    ledger = summary["ledger"]
    assert all(ledger[g]["state"] == "consumed" for g in before)
    for r in rows[-(STEPS - saved_step):]:
        assert min(r["versions"]) >= r["step"] - 1 - 1  # staleness 1 from the resumed version on
