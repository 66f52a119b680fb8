"""One command line for every entry point (``osvl.config.parse_args``, ``cli``; ``serve.app.service_flags``).

Each ``jobs/*.py`` and Serve app runs as a user runs it, in a subprocess: ``--help`` exits 0 and shows the
values the selected profile gives (not the dataclass defaults); a misspelt key exits 2 with one line on
stderr and no traceback; ``--print_config`` prints the resolved config and exits 0. In-process: ``--key
value`` reads as ``--key=value``, and ``--print_config`` prints exactly what the job then logs as its config.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from osvl.config import CONFIG_DIR, normalize_args, parse_args
from osvl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py"))
SERVE = ["serve.app", "serve.agent_app", "serve.mcp_app"]
ENTRY_POINTS = [[f"jobs/{j}.py"] for j in JOBS] + [["-m", m] for m in SERVE]


def leaves(d: dict, prefix: str = "") -> dict[str, object]:
    """Scalar leaves of a nested mapping by dotted key (lists and scalars; nested mappings are walked)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Each entry point with --help, with --print_config and with a misspelt key, 4 at a time."""
    calls = [(" ".join(e), flag) for e in ENTRY_POINTS for flag in ("--help", "--print_config", "--rll.lr=1")]

    def one(call: tuple[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *call[0].split(), call[1]], cwd=REPO, capture_output=True,
                              text=True, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(calls, pool.map(one, calls), strict=True))


@pytest.mark.slow  # 36 interpreter starts, ~25 s on 2 cores
@pytest.mark.parametrize("entry", [" ".join(e) for e in ENTRY_POINTS])
def test_help_shows_the_profiles_values_and_print_config_the_resolved_config(runs, entry):
    help_, printed = runs[(entry, "--help")], runs[(entry, "--print_config")]
    assert help_.returncode == 0, help_.stderr[-2000:]
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "usage:" in help_.stdout and "Traceback" not in help_.stderr
    resolved = leaves(yaml.safe_load(printed.stdout))
    assert resolved, printed.stdout
    job = entry.removeprefix("jobs/").removesuffix(".py")
    profile = CONFIG_DIR / job / "demo.yaml"
    lines = [line.strip().split("  (")[0] for line in help_.stdout.splitlines()]
    if profile.is_file():  # every value the profile sets is shown as it sets it, not as the default
        assert "values below: profile 'demo'" in help_.stdout
        for key, value in leaves(yaml.safe_load(profile.read_text()) or {}).items():
            shown = json.dumps(resolved.get(key, value))
            if f"--{key}={shown}" in lines:
                continue
            # a section typed as a mapping (grpo's synth, trajectories, sft) is one line of JSON
            top = next(line for line in lines if line.startswith(f"--{key.split('.')[0]}="))
            assert f'"{key.split(".")[-1]}": {json.dumps(value)}' in top, (key, value, top[:300])
    if entry == "jobs/grpo.py":  # the plan flags live outside the config: the usage lines name them
        assert "--check[=MODEL_DIR] [--cluster=cluster.yaml] [--gpu_memory_gb=80]" in help_.stdout, help_.stdout[:600]
    shown = [k for k in resolved if f"--{k}=" in help_.stdout]
    assert len(shown) >= 0.8 * len(resolved), sorted(set(resolved) - set(shown))


@pytest.mark.slow
@pytest.mark.parametrize("entry", [" ".join(e) for e in ENTRY_POINTS])
def test_a_misspelt_key_is_one_line_and_exit_code_2(runs, entry):
    out = runs[(entry, "--rll.lr=1")]
    assert out.returncode == 2, (out.returncode, out.stdout[-1000:], out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith("error: unknown config key 'rll")


def test_key_space_value_reads_as_key_equals_value():
    from osvl.sft.job import JOB, SftConfig

    assert normalize_args(["--lr", "0.01", "--bf16", "--run.seed", "-1", "-h", "--print_config"]) == [
        "--lr=0.01", "--bf16=true", "--run.seed=-1", "--help", "--print_config"]
    cfg = parse_args(SftConfig, JOB, ["--profile", "production", "--lr", "0.01", "--run.seed", "-1"])
    assert (cfg.lr, cfg.run.seed) == (0.01, -1)
    assert cfg.zero_stage == parse_args(SftConfig, JOB, ["--profile=production"]).zero_stage
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        parse_args(SftConfig, JOB, ["--lrr", "0.01"])


def test_print_config_prints_what_the_job_logs(capsys):
    from osvl.logs import start_job
    from osvl.sft.job import JOB, SftConfig

    argv = ["--lr", "0.02", "--max_steps=7"]
    start_job(SftConfig, JOB, argv)
    logged = capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        start_job(SftConfig, JOB, [*argv, "--print_config"])
    printed = capsys.readouterr().out
    assert stop.value.code == 0 and "lr: 0.02" in printed and "max_steps: 7" in printed
    assert f"sft config:\n{printed.rstrip()}" in logged.out + logged.err
