"""SFT under Ray Train + DeepSpeed, for real: ZeRO-2 == ZeRO-3, and a driver SIGKILLed after a
checkpoint resumes with the same step count, Adam moments and losses as an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from osvl.config import parse_args
from osvl.train.sft import JOB, SftConfig, is_val, loss_curve, lr_lambda, run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    """48 short teacher-style records (0-1 images, 0-3 tool turns) in a write_trajectories folder."""
    from test_batch import _record

    from osvl.agent.trajectory import write_trajectories
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint

    processor = load_processor(tiny_checkpoint("qwen3_vl"))
    out = tmp_path_factory.mktemp("sft_data")
    recs, imgs = [], {}
    for k in range(48):
        tr, im = _record(processor, [0, 1, 1][k % 3], f"what is question {k} about?", k % 4, f"q{k}", k)
        recs.append(tr)
        imgs.update(im)
    write_trajectories(out, recs[:24], imgs)  # two part files: the order must survive both
    write_trajectories(out, recs[24:], imgs)
    return out


def _args(data: Path, root: Path, *extra: str) -> list[str]:
    return [f"--run.root={root}", f"--data.trajectories={data}", "--data.n_eval=0", "--data.val_fraction=0",
            "--micro_batch=2", "--num_workers=2", "--threads_per_worker=1", "--lr=2e-3", "--log_every=1",
            "--val_every=0", *extra]


def _main(argv: list[str]) -> dict:
    """What ``python jobs/sft.py ARGV`` does, in this process (on the session's Ray cluster)."""
    return run(parse_args(SftConfig, JOB, argv))


def _log(run_root: Path) -> dict[int, dict]:
    (log,) = run_root.glob("sft/*/train_log.jsonl")
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


def _moments(run_root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's ZeRO optimizer state in the newest checkpoint (Adam moments included)."""
    ckpts = sorted(run_root.glob("sft/*/train/checkpoint_*"), key=lambda p: p.name)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)

    for f in sorted((ckpts[-1] / "ds").glob("zero_pp_rank_*_optim_states.pt")):
        walk(f.name, torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"])
    return out


def test_lr_schedule_and_split():
    f = lr_lambda(100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))
    qids = [f"q{i}" for i in range(2000)]
    share = sum(is_val(q, 0.1) for q in qids) / len(qids)
    assert 0.07 < share < 0.13 and not any(is_val(q, 0.0) for q in qids)


@pytest.mark.slow
def test_zero3_matches_zero2_and_the_hf_dir_generates(trajectories, tmp_path, ray_cluster):
    from osvl.models.load import load_model, load_processor

    reports = {}
    for stage in (2, 3):
        reports[stage] = _main(_args(trajectories, tmp_path / f"z{stage}", f"--zero_stage={stage}", "--max_steps=5",
                                    "--ckpt_every=5"))
    l2, l3 = _log(tmp_path / "z2"), _log(tmp_path / "z3")
    assert sorted(l2) == sorted(l3) == [1, 2, 3, 4, 5]
    for s in l2:
        assert abs(l2[s]["loss"] - l3[s]["loss"]) < 1e-3, (s, l2[s]["loss"], l3[s]["loss"])
    assert l2[5]["loss"] < l2[1]["loss"]
    # the ZeRO-3 run's exported directory is an ordinary checkpoint that loads and generates
    model_dir = reports[3]["model"]
    model, processor = load_model(model_dir), load_processor(model_dir)
    ids = processor.tokenizer("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                              return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.slow
def test_sigkill_after_checkpoint_resumes_exactly(trajectories, tmp_path, ray_cluster):
    """Driver killed with SIGKILL once a checkpoint is registered; the same command resumes from it."""
    steps = ["--max_steps=9", "--ckpt_every=2", "--keep=2"]
    _main(_args(trajectories, tmp_path / "ref", *steps))  # the uninterrupted run, in-process
    ref = _log(tmp_path / "ref")

    root = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "jobs" / "sft.py"), *_args(trajectories, root, *steps)]
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own local cluster, as a user's rerun would get
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            snaps = list(root.glob("sft/*/train/checkpoint_manager_snapshot.json"))
            try:
                if snaps and json.loads(snaps[0].read_text()).get("checkpoint_results"):
                    break
            except ValueError:  # caught mid-write
                pass
            time.sleep(0.2)
        assert proc.poll() is None, "the run finished (or failed) before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    time.sleep(2)  # the killed driver's cluster goes down with it (Ray fate-shares with the driver)
    killed_at = max(_log(root))
    assert killed_at < 9

    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = [int(x.rsplit(" ", 1)[1].split("/")[0]) for x in out.stdout.splitlines() + out.stderr.splitlines()
               if "sft: resumed at step" in x]
    assert resumed and resumed[0] >= 2 and resumed[0] % 2 == 0, out.stdout[-2000:]
    start = resumed[0]
    log = _log(root)
    assert sorted(log) == list(range(1, 10))  # the step count continued to the end
    for s in range(start + 1, start + 4):
        assert abs(log[s]["loss"] - ref[s]["loss"]) < 1e-5, (s, log[s]["loss"], ref[s]["loss"])
    # Adam moments (and every other optimizer tensor) of the final checkpoints match
    a, b = _moments(tmp_path / "ref"), _moments(root)
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5, rtol=0), k
    assert not math.isnan(log[9]["loss"])


def test_loss_curve_prints_start_and_end(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": i, "loss": 5.0 / i}) + "\n" for i in range(1, 21)))
    text = loss_curve(log)
    assert "5.000 -> 0.250" in text and "20:0.250" in text
