"""``jobs/grpo.py --check``: the plan of the production run on a cluster description, and one line for each
thing that would break there, found without starting anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the production profile as the RayJob submits it (deploy/rayjob-grpo.yaml's entrypoint)
ENTRYPOINT = ["--profile=production", "--run.root=s3://YOUR-BUCKET/osvl-runs", "--model=/data/models/osvl-sft",
              "--questions=/data/synthesize/production"]
# sized down to Qwen3-VL-2B at 4,096 tokens, with room to spare: each planted change below must add exactly its own line
FITS = ["--check=configs/models/qwen3-vl-2b", "--rl.max_len=4096", "--rollout.agent.max_episode_tokens=4096"]


def _grpo(args: list[str], capsys) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location("grpo_job", REPO / "jobs" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as done:
        module.main(args)
    return done.value.code, capsys.readouterr().out


@pytest.mark.parametrize("cluster", ["cluster.yaml", "deploy/rayjob-grpo.yaml"])
def test_the_production_entrypoint_fits_the_clusters_and_prints_its_plan(cluster, capsys, monkeypatch):
    """bf16 with fp32 master weights, gradient checkpointing, the reference model partitioned on the GPUs and
    micro-batches of a token budget that may split a group: Qwen3-VL-8B's learner fits even cluster.yaml's
    40 GiB GPUs (in fp32, without checkpointing and with a group of 8 x 16,384 tokens per micro-batch it
    needed 1,315 GiB per GPU)."""
    monkeypatch.chdir(REPO)
    code, out = _grpo([*ENTRYPOINT, "--check=configs/models/qwen3-vl-8b", f"--cluster={cluster}"], capsys)
    assert code == 0 and out.rstrip().endswith("check: OK"), out
    assert "model: 8.77 B parameters (0.58 B vision), 36 layers, hidden 4096" in out  # counted from the config.json
    assert "rollout: 4 actor(s), each {CPU: 4, GPU: 1, {'rollout': 1.0}}, engine vllm" in out
    assert "'dtype': 'bfloat16', 'enforce_eager': False" in out and "'max_model_len': 16384" in out
    assert "learner: 8 worker(s), each {'CPU': 8.0, 'GPU': 1.0, 'learner': 1.0}, ZeRO-3, bf16 weights" in out
    assert "micro-batch ceiling: 16384 tokens" in out and "= 34.3 GiB (of" in out


@pytest.mark.parametrize(("planted", "line"), [
    (["--rollout.num_gpus=0"], "rollout.num_gpus=0 with engine vllm on a GPU cluster"),
    (["--rollout.vllm.max_model_len=2048"], "rollout.vllm.max_model_len=2048 is below the episode budget"),
    (["--rollout.role_units=16"], "rollout: 16 unit(s) of the 'rollout' resource asked, no node type offers"),
    (["--learner.workers=16"], "learner: 16 workers need 16 GPUs on one node; the largest learner node type has 8"),
    (["--learner.grad_checkpointing=false", "--rl.micro_tokens=16384"],
     "learner: 43 GiB per GPU needed (micro-batch of up to 16384 tokens, bf16, gradient checkpointing off)"),
    (["--rl.micro_tokens=65536"], "learner: 53 GiB per GPU needed (micro-batch of up to 65536 tokens, bf16, gradient "
                                  "checkpointing on)"),
])
def test_each_planted_inconsistency_is_one_line(planted, line, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out = _grpo([*ENTRYPOINT, *FITS, *planted], capsys)
    fails = [x for x in out.splitlines() if x.startswith("check: FAIL")]
    assert code == 1 and len(fails) == 1 and fails[0].startswith(f"check: FAIL {line}"), out


def test_check_without_a_model_config_says_how_to_give_one(capsys, monkeypatch):
    from osvl.errors import ConfigError

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="--check needs the model's config.json"):
        _grpo(["--profile=production", "--check"], capsys)
