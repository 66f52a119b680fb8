"""Every choice field of every job is a closed set (a ``Literal``) that the command line checks before
any stage runs: a misspelt engine, transport or policy fails at once, naming the field and its choices,
instead of after an hour of synthesis, trajectories and SFT."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest

from osvl.config import apply_override, parse_args
from osvl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _jobs() -> dict[str, tuple[str, type]]:
    """Each entry point's job name and config type (the sub-jobs the GRPO job chains included)."""
    from jobs.ask import JOB as ASK
    from jobs.ask import AskConfig
    from osvl.eval.job import JOB as EVAL
    from osvl.eval.job import EvalConfig
    from osvl.expert.job import JOB as TRAJ
    from osvl.expert.job import TrajConfig
    from osvl.kg.job import JOB as BUILD_KG
    from osvl.kg.job import BuildKGConfig
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB as GRPO
    from osvl.sft.job import JOB as SFT
    from osvl.sft.job import SftConfig
    from osvl.synth.job import JOB as SYNTH
    from osvl.synth.job import SynthConfig
    from serve.agent_app import AgentServeConfig

    return {"grpo": (GRPO, GRPOJobConfig), "eval": (EVAL, EvalConfig), "synthesize": (SYNTH, SynthConfig),
            "trajectories": (TRAJ, TrajConfig), "sft": (SFT, SftConfig), "build_kg": (BUILD_KG, BuildKGConfig),
            "ask": (ASK, AskConfig), "agent_app": ("agent_app", AgentServeConfig)}


def _fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, type) of every leaf field, sections walked."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _fields(tp, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, tp))
    return out


# The choice fields the recipe's configs had as plain strings: each must stay a closed set.
CHOICES = {
    "grpo": ["rollout.engine", "rollout.tools", "learner.weights", "rl.truncation", "rl.mode", "rl.mask_at",
             "rl.aggregation", "rl.baseline", "rollout.agent.overflow", "rollout.text_search.backend",
             "rollout.reward.prefix_end", "rollout.reward.judge", "rollout.reward.query_scorer",
             "rollout.reward.fmt_scope"],
    "eval": ["engine", "tools", "judge", "tool_cache", "agent.overflow"],
    "synthesize": ["rewriter.kind", "filter.difficulty.engine"],
    "trajectories": ["teacher.kind", "tools.cache", "split", "tiny_kind", "agent.overflow", "reward.judge",
                     "reward.fmt_scope"],
    "sft": ["truncation", "tiny_kind"],
    "build_kg": ["format"],
    "ask": ["engine", "tools"],
    "agent_app": ["engine", "tools"],
}


def test_the_choice_fields_are_closed_sets():
    for name, (_, cls) in _jobs().items():
        types = dict(_fields(cls))
        loose = [key for key in CHOICES[name] if get_origin(types[key]) is not Literal]
        assert not loose, f"{name}: choice fields typed as open strings: {loose}"


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_a_misspelt_choice_fails_at_parse_naming_the_field_and_its_choices(name):
    job, cls = _jobs()[name]
    literals = [(key, get_args(tp)) for key, tp in _fields(cls) if get_origin(tp) is Literal]
    assert literals
    for key, choices in literals:
        with pytest.raises(ConfigError) as err:
            if name == "agent_app":  # its own parser (python -m serve.agent_app), over the same override code
                apply_override(cls(), key, "not-a-choice")
            else:
                parse_args(cls, job, [f"--{key}=not-a-choice"])
        msg = str(err.value)
        assert msg.startswith(f"{key}: 'not-a-choice' is not one of"), msg
        assert all(repr(c) in msg for c in choices), msg


def test_the_grpo_job_refuses_a_misspelt_engine_before_building_anything(tmp_path):
    # no wall-clock bound: beside another test worker the imports alone took 11 s; what must hold is that the
    # refusal comes from parsing, before any stage writes to the run root or starts Ray (the timeout is a hang guard)
    proc = subprocess.run([sys.executable, "jobs/grpo.py", "--rollout.engine=vlm", f"--run.root={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rollout.engine: 'vlm' is not one of 'hf', 'vllm'" in proc.stderr
    assert not any(tmp_path.iterdir())  # no stage ran, no Ray started


def test_vllm_runs_bf16_with_cuda_graphs_on_gpu_and_exactly_on_cpu():
    from osvl.agent.engines import VLLMOptions, vllm_args

    cpu, gpu = vllm_args(VLLMOptions(), 16384, gpu=False), vllm_args(VLLMOptions(), 16384, gpu=True)
    assert (cpu["dtype"], cpu["enforce_eager"], cpu["max_model_len"]) == ("float32", True, 16384)
    assert (gpu["dtype"], gpu["enforce_eager"], gpu["max_model_len"]) == ("bfloat16", False, 16384)
    assert "tensor_parallel_size" not in gpu  # one GPU: vLLM's in-process executor
    tp = vllm_args(VLLMOptions(tensor_parallel_size=2, max_model_len=32768, dtype="float16"), 16384, gpu=True)
    assert (tp["tensor_parallel_size"], tp["distributed_executor_backend"], tp["max_model_len"], tp["dtype"]) == (
        2, "mp", 32768, "float16")


@pytest.mark.parametrize(("flags", "message"), [
    (["--rollout.vllm.max_model_len=8192"], "rollout.vllm.max_model_len=8192 is below the episode budget "
                                            "agent.max_episode_tokens=16384"),
    (["--rollout.vllm.tensor_parallel_size=2", "--rollout.num_gpus=1"],
     "rollout.vllm.tensor_parallel_size=2 needs rollout.num_gpus=2"),
    (["--rollout.python=/no/such/python"], "rollout.python: no Python interpreter at '/no/such/python'"),
    (["--rollout.python="], "rollout.engine=vllm: vLLM is not installed in this environment"),  # this one has none
])
def test_a_vllm_setting_that_would_fail_on_the_cluster_fails_at_start(flags, message):
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB

    cfg = parse_args(GRPOJobConfig, JOB, ["--rollout.engine=vllm", f"--rollout.python={sys.executable}",
                                       "--rollout.agent.max_episode_tokens=16384", *flags])
    with pytest.raises(ConfigError) as err:
        cfg.rollout.check()
    assert str(err.value).startswith(message), err.value
