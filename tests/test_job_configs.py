"""The jobs' configs nest shared sections instead of mirroring them: the GRPO rollout's agent and reward
sections, the difficulty filter inside the synthesize job's config, and jobs/grpo.py's upstream stages as
typed sections (osvl.recipe). Real profiles, real ``--help`` output, real run folders."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from osvl.agent.loop import AgentConfig
from osvl.agent.reward import RewardConfig
from osvl.config import parse_args
from osvl.errors import ConfigError
from osvl.expert.job import TrajConfig
from osvl.recipe import GRPOJobConfig
from osvl.rl.job import JOB
from osvl.rl.rollout import RolloutConfig

REPO = Path(__file__).resolve().parents[1]


def test_rollout_holds_the_agent_and_reward_sections_the_trajectories_job_holds():
    rollout, traj = RolloutConfig(), TrajConfig()
    assert type(rollout.agent) is type(traj.agent) is AgentConfig
    assert type(rollout.reward) is type(traj.reward) is RewardConfig
    cfg = parse_args(GRPOJobConfig, JOB, ["--rollout.agent.max_turns=5", "--rollout.reward.alpha=0.5"])
    assert cfg.rollout.agent.max_turns == 5 and cfg.rollout.reward.alpha == 0.5
    with pytest.raises(ConfigError, match="rollout.max_turns"):  # the old mirrored key is gone
        parse_args(GRPOJobConfig, JOB, ["--rollout.max_turns=5"])


def test_grpo_demo_profile_keeps_its_episode_budgets_and_reward():
    """The demo's effective values before the sections nested (its reward figures depend on them)."""
    cfg = parse_args(GRPOJobConfig, JOB, [])
    episode, greedy = cfg.rollout.episode_agent(), cfg.rollout.episode_agent(greedy=True)
    assert (episode.max_turns, episode.max_new_tokens, episode.max_episode_tokens) == (6, 128, 3072)
    assert (episode.k, episode.stop_on_fatal, episode.temperature) == (3, True, 0.7)
    assert (cfg.rollout.reward.alpha, cfg.rollout.reward.fmt_scope) == (0.8, "episode")
    assert greedy.temperature == 0.0 and greedy.max_turns == 6  # held-out Pass@1: the same budgets, greedy
    prod = parse_args(GRPOJobConfig, JOB, ["--profile=production"])
    assert (prod.rollout.agent.max_turns, prod.rollout.agent.max_new_tokens) == (16, 1024)


def test_rollout_check_asks_an_llm_judge_for_its_endpoint_and_refuses_bad_budgets():
    for flag in ("--rollout.reward.judge=llm", "--rollout.reward.judge=rule_then_llm",
                 "--rollout.reward.query_scorer=llm"):
        with pytest.raises(ConfigError, match="rollout.judge needs base_url and model"):
            parse_args(GRPOJobConfig, JOB, [flag]).rollout.check()
        parse_args(GRPOJobConfig, JOB, [flag, "--rollout.judge.base_url=http://127.0.0.1:9/v1",
                                     "--rollout.judge.model=judge"]).rollout.check()
    with pytest.raises(ConfigError, match="max_turns"):
        parse_args(GRPOJobConfig, JOB, ["--rollout.agent.max_turns=0"]).rollout.check()


def test_grpo_help_lists_the_nested_sections():
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "grpo.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "--rollout.agent.max_turns=" in out and "--rollout.reward.fmt_scope=" in out
    assert "--rollout.max_turns=" not in out


def test_synthesize_help_lists_the_difficulty_filter_settings():
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "synthesize.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for key in ("stages", "engine", "model", "endpoint.base_url", "max_new_tokens", "top_k", "report"):
        assert f"--filter.difficulty.{key}=" in out, key
    tracked = subprocess.run(["git", "grep", "-l", "OSVL_" + "DIFFICULTY"], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout == "", tracked.stdout  # the environment no longer configures the filter


def test_two_difficulty_settings_land_in_two_run_folders(tmp_path):
    from osvl.config import run_dir
    from osvl.synth.job import JOB as SYNTH
    from osvl.synth.job import SynthConfig, validate

    base = [f"--run.root={tmp_path}", "--filter.stage=osvl.synth.difficulty:DifficultyFilter"]
    one = parse_args(SynthConfig, SYNTH, [*base, "--filter.difficulty.stages=one_image_search"])
    two = parse_args(SynthConfig, SYNTH, [*base, "--filter.difficulty.stages=one_image_search",
                                          "--filter.difficulty.top_k=3"])
    moved = parse_args(SynthConfig, SYNTH, [*base, "--filter.difficulty.stages=one_image_search",
                                            f"--filter.difficulty.report={tmp_path / 'drops.jsonl'}"])
    folders = {run_dir(cfg, SYNTH) for cfg in (one, two, moved)}
    assert len(folders) == 2 and run_dir(one, SYNTH) == run_dir(moved, SYNTH)  # where to report is not a setting
    assert all((f / "config.yaml").is_file() and f.parent == tmp_path / SYNTH for f in folders)
    assert "top_k: 3" in (run_dir(two, SYNTH) / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="filter.difficulty.stages"):
        validate(parse_args(SynthConfig, SYNTH, ["--filter.difficulty.stages=no_tools,three_hops"]))


def _grpo_job():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_job", REPO / "jobs" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_upstream_sections_are_typed_configs_of_their_jobs_from_their_demo_profiles():
    """jobs/grpo.py's synth / trajectories / sft sections are the sub-jobs' own configs (no dict[str, Any]):
    each starts from that job's demo profile, then the GRPO profile's entries, then the flags, each value
    read by its field's type, as every other flag is."""
    from osvl.expert.job import TrajConfig
    from osvl.sft.job import SftConfig
    from osvl.synth.job import SynthConfig

    args = ["--synth.walk.hops=2,3", "--synth.walk.hop_probs=0.5,0.5", "--sft.epochs=4", "--sft.max_len=1024",
            "--trajectories.agent.max_turns=12", "--trajectories.teacher.oracle.think=full"]
    cfg = parse_args(GRPOJobConfig, JOB, args)
    assert isinstance(cfg.synth, SynthConfig) and isinstance(cfg.trajectories, TrajConfig)
    assert isinstance(cfg.sft, SftConfig)
    assert cfg.synth.walk.hops == [2, 3] and cfg.synth.walk.hop_probs == [0.5, 0.5]
    assert cfg.synth.walk.entity_answers is False and cfg.synth.degrade.share == 0.0  # the GRPO profile's
    assert cfg.sft.epochs == 4.0 and isinstance(cfg.sft.epochs, float) and cfg.sft.max_len == 1024
    assert cfg.sft.lr == parse_args(SftConfig, "sft", []).lr  # what the GRPO profile leaves: jobs/sft.py's demo
    assert cfg.trajectories.agent.max_turns == 12 and cfg.trajectories.max_questions == 1000
    assert cfg.trajectories.teacher.oracle.think == "full" and cfg.trajectories.teacher.oracle.top_k == 3
    hints = typing.get_type_hints(GRPOJobConfig)
    assert not [name for name, tp in hints.items() if "dict[str, Any]" in str(tp) or tp is dict]


@pytest.mark.parametrize(("flag", "message"), [
    ("--synth.walk.hopz=2", "unknown config key 'synth.walk.hopz'"),
    ("--sft.epochs=many", "sft.epochs: expected float"),
    ("--trajectories.agent.max_turns=2.5", "trajectories.agent.max_turns: expected int"),
    ("--synth.num_shards.x=1", "synth.num_shards is not a section"),
])
def test_a_wrong_sub_job_key_or_type_fails_at_start_naming_it(flag, message, tmp_path, capsys):
    grpo = _grpo_job()
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        grpo.main([f"--run.root={tmp_path}", flag])
    assert capsys.readouterr().out == "" and not any(tmp_path.iterdir())  # nothing printed, nothing built


def test_a_wrong_sub_job_entry_in_a_profile_fails_at_start(tmp_path):
    profile = tmp_path / "bad.yaml"
    profile.write_text("sft:\n  data:\n    n_evl: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'sft\.data\.n_evl'"):
        _grpo_job().main([f"--profile={profile}", f"--run.root={tmp_path}"])


def test_the_grpo_job_builds_its_records_with_the_rollouts_search_engine(tmp_path):
    """The SFT records' observations must be what the rollouts' tools return for the same queries: records
    searched by BM25 and rollouts re-ranked by MiniLM gave the demo policy other hits for the queries it was
    taught (docs/design.md, "One search engine for records, rollouts and evaluation")."""
    from osvl.config import config_hash
    from osvl.recipe import check, records_config

    cfg = parse_args(GRPOJobConfig, JOB, [f"--run.root={tmp_path}"])
    tcfg = records_config(cfg, tmp_path)
    assert tcfg.text_search == cfg.rollout.text_search and not cfg.rollout.text_search.dense_rerank
    assert tcfg.offer == cfg.rollout.offer == ["image_search", "text_search"] and tcfg.questions == str(tmp_path)
    # the committed base as the profile names it, not this checkout's absolute path: the records' run hash
    # (and so the SFT run's) is the same in every clone and under `ray job submit --working-dir`
    assert tcfg.model == "osvl/models/weights/tiny_policy"
    reranked = parse_args(GRPOJobConfig, JOB, [f"--run.root={tmp_path}", "--rollout.text_search.dense_rerank=true"])
    other = records_config(reranked, tmp_path)
    assert other.text_search.dense_rerank and config_hash(other) != config_hash(tcfg)
    check(cfg)  # the profile sets no recipe input
    for flag, instead in [("--trajectories.text_search.dense_rerank=true", "rollout.text_search"),
                          ("--trajectories.offer=crop", "rollout.offer"), ("--trajectories.model=x", "sft.model"),
                          ("--sft.data.trajectories=x", "the trajectories section"),
                          ("--synth.run.seed=3", "run.seed")]:
        with pytest.raises(ConfigError, match=f"set by the recipe from {instead}"):
            check(parse_args(GRPOJobConfig, JOB, [f"--run.root={tmp_path}", flag]))
