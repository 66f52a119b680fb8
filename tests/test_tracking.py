"""Experiment tracking (osvl/tracking.py): scalars that TensorBoard reads back, the no-op tracker, the typed error
for a backend that is not installed, ``<root>/<job>/latest`` and ``<root>/runs.jsonl``, and the eval job's Pass@1.

A real GRPO run's event files (reward and fatal rate per step) are checked by the rollout-actor fault test of
tests/test_grpo_faults.py, and a real SFT run's by the ZeRO-3 test of tests/test_sft.py: no extra run here.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys

import pytest

from osvl.config import RunConfig, config_hash, opt, parse_args, run_dir
from osvl.errors import ConfigError, DataError
from osvl.tracking import INDEX, LATEST, TB_DIR, Tracker, job_run, read_scalars, tracked


@dataclasses.dataclass
class Job:
    run: RunConfig = opt(RunConfig, "Run root and seed.")
    lr: float = opt(0.1, "Learning rate.")


def _cfg(*args: str) -> Job:
    return parse_args(Job, "toy", list(args), default_profile="")


def test_tracker_writes_scalars_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    row = {"step": 1, "time": 1.7e9, "reward": 0.5, "fatal_rate": 0.25, "skipped": True, "groups": 3,
           "weights": {"rebuilds": 2, "sha256": "ab12"}, "versions": [0, 1], "mode": "fatal_aware", "kl": None}
    with Tracker(tmp_path, ["tensorboard"]) as tracker:
        logged = tracker.log(row, step=1)
        tracker.log({"reward": 0.75, "fatal_rate": 0.0}, step=2)
    # every numeric field, nested counters as outer/inner; the x axis, wall time, text, lists and None left out
    assert logged == {"reward": 0.5, "fatal_rate": 0.25, "skipped": 1.0, "groups": 3.0, "weights/rebuilds": 2.0}
    acc = EventAccumulator(str(tmp_path / TB_DIR))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["fatal_rate", "groups", "reward", "skipped", "weights/rebuilds"]
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("fatal_rate")] == [(1, 0.25), (2, 0.0)]
    assert [(e.step, e.value) for e in acc.Scalars("weights/rebuilds")] == [(1, 2.0)]
    assert read_scalars(tmp_path)["reward"] == [(1, 0.5), (2, 0.75)]


def test_a_disabled_tracker_does_nothing(tmp_path):
    for tracker in (Tracker.disabled(), Tracker(tmp_path, []), Tracker.for_run(tmp_path, RunConfig(tracking=[]))):
        assert not tracker.enabled and tracker.log({"reward": 1.0}, step=1) == {}
        tracker.publish()
        tracker.close()
    assert not any(tmp_path.iterdir())


def test_selecting_wandb_or_mlflow_when_not_installed_is_a_config_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed, also where it is
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for backend in ("wandb", "mlflow"):
        with pytest.raises(ConfigError, match=f"'{backend}' but the {backend} package is not installed.*"
                                              f"pip install {backend}"):
            Tracker(tmp_path, ["tensorboard", backend])
    assert not any(tmp_path.iterdir())  # checked before any backend opened: no event file either
    # from the command line, a job fails at its start, before its run folder or the index is written
    cfg = _cfg(f"--run.root={tmp_path}", "--run.tracking=tensorboard,wandb", "--run.tracking_project=p")
    assert cfg.run.tracking == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="wandb package is not installed"), job_run(cfg, "toy"):
        pass
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="run.tracking\\[0\\]: 'tensorbord' is not one of"):
        _cfg("--run.tracking=tensorbord")
    # where a job logs is not what it produces: the run folder (config hash) does not change
    assert config_hash(cfg) == config_hash(_cfg(f"--run.root={tmp_path}")) == config_hash(_cfg("--run.tracking="))


def test_latest_and_the_run_index_after_two_runs_and_a_failed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["jobs/toy.py", "--lr=0.2"])

    @tracked("toy")
    def run(cfg: Job, fail: bool = False):
        out = run_dir(cfg, "toy")
        assert (tmp_path / "toy" / LATEST).resolve() == out.resolve()  # pointed at it when the job started
        if fail:
            raise DataError("broken input")
        return out

    t0 = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    first = run(_cfg(f"--run.root={tmp_path}"))
    second = run(_cfg(f"--run.root=file://{tmp_path}", "--lr=0.2", "--run.name=named"))
    link = tmp_path / "toy" / LATEST
    assert link.is_symlink() and os.readlink(link) == "named" and link.resolve() == second.resolve()
    with pytest.raises(DataError):
        run(_cfg(f"--run.root={tmp_path}", "--lr=0.3"), fail=True)
    folders = {p.name for p in (tmp_path / "toy").iterdir() if not p.is_symlink()}
    # the newest start, failed or not
    assert len(folders) == 3 and os.readlink(link) in folders - {first.name, second.name}
    assert not [p for p in (tmp_path / "toy").iterdir() if p.name.endswith(".tmp")]

    lines = [json.loads(x) for x in (tmp_path / INDEX).read_text().splitlines()]
    assert [(x["job"], x["status"]) for x in lines] == [("toy", "started"), ("toy", "finished")] * 2 + [
        ("toy", "started"), ("toy", "failed")]
    starts, ends = lines[0::2], lines[1::2]
    assert [s["run_id"] for s in starts] == [e["run_id"] for e in ends] and len({s["run_id"] for s in starts}) == 3
    assert starts[0]["folder"] == first.name == starts[0]["config_hash"]
    assert starts[1]["folder"] == "named" and starts[1]["config_hash"] == config_hash(_cfg("--lr=0.2"))
    assert all(s["argv"] == ["jobs/toy.py", "--lr=0.2"] for s in starts)
    for s in starts:
        when = datetime.datetime.fromisoformat(s["start"])
        assert when.utcoffset() == datetime.timedelta(0) and when >= t0
    assert ends[2]["error"] == "DataError" and "error" not in ends[0] and ends[0]["seconds"] >= 0


def test_eval_pass_at_1_per_benchmark_and_mode_at_step_0(tmp_path):
    from osvl.eval.job import EvalConfig, log_scalars

    table = {"pass_at_1": 0.5, "fatal_rate": 0.25, "mean_turns": 2.0, "mean_tool_calls": 1.0, "items": 4,
             "failures": {}, "judge_agreement": None}
    summary = {"benchmarks": {"generic": {"modes": {"direct": table, "agentic": {**table, "pass_at_1": 0.75}}},
                              "rl_release": {"modes": {"direct": {**table, "pass_at_1": 0.0}}}}}
    log_scalars(tmp_path, EvalConfig(), summary)
    tb = read_scalars(tmp_path)
    assert {k: v for k, v in tb.items() if k.startswith("pass_at_1/")} == {
        "pass_at_1/generic/direct": [(0, 0.5)], "pass_at_1/generic/agentic": [(0, 0.75)],
        "pass_at_1/rl_release/direct": [(0, 0.0)]}
    assert tb["fatal_rate/generic/direct"] == [(0, 0.25)]
