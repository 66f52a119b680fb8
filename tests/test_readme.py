"""Every command in the bash blocks of the README and of the docs pages (docs/*.md) runs, as written, on this machine.

`make test` is the one exception: it is the command that runs this file (CI runs it). The README is the landing
page; the usage pages it links hold the other commands, so they are run too, page by page in order.
Commands run in the repository with ``OSVL_RUN_ROOT`` pointing at a temporary folder
so the test never touches a user's runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {"make test"}
# `make demo` is the whole chain (~20 min on 2 cores): here it runs the same job at toy sizes, so the
# suite checks every stage is wired (questions -> trajectories -> SFT -> GRPO -> Pass@1) within budget
# (two questions per seed entity: the demo's ~3,300 questions took most of this test's minutes)
SMALL_DEMO = ("make demo DEMO_ARGS='--synth.questions_per_seed=2 --trajectories.max_questions=8 --sft.max_steps=2 "
              "--train.steps=2 --train.ckpt_every=1 --eval.n_heldout=2'")


def bash_blocks(page: Path) -> list[list[str]]:
    """The commands of each ```bash block of one Markdown page, in order (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    out = []
    for block in blocks:
        lines = [line.split("  #")[0].strip() for line in block.splitlines()]
        out.append([line for line in lines if line and not line.startswith("#")])
    return out


def readme_blocks() -> list[list[str]]:
    return bash_blocks(REPO / "README.md")


def doc_pages() -> list[Path]:
    """The README, then every docs page by name."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_blocks() -> list[list[str]]:
    """Every page's bash blocks: a block that depends on an earlier one (a cluster started, then used)
    sits on the same page after it, and pages run one after the other."""
    return [block for page in doc_pages() for block in bash_blocks(page)]


def test_readme_shows_the_two_commands():
    commands = [c for block in readme_blocks() for c in block]
    assert "make demo" in commands and "make test" in commands


def test_the_docs_pages_hold_the_moved_commands():
    """The landing page keeps its two commands; the usage pages hold the rest, all collected for the run
    below: a block that starts the head node stops it too, and `make test` is only on the README."""
    readme = [c for block in readme_blocks() for c in block]
    every = [c for block in all_blocks() for c in block]
    assert set(readme) < set(every), "no bash block collected from docs/*.md"
    assert all(("make ray-up" in block) == ("make ray-down" in block) for block in all_blocks())
    assert every.count("make test") == readme.count("make test") == 1


def run(command: str, env: dict[str, str], timeout: int = 1500) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"`{command}` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, record_property):
    env = {**os.environ, "OSVL_RUN_ROOT": str(tmp_path / "runs")}
    ran = []
    for block in all_blocks():
        cleanup = "make ray-down" if "make ray-up" in block else None
        try:
            for command in block:
                if command in SKIP:
                    continue
                t0 = time.monotonic()
                out = run(SMALL_DEMO if command == "make demo" else command, env)
                record_property("seconds", (command[:100], round(time.monotonic() - t0, 1)))  # where its time goes
                ran.append(command)
                if command == "make demo":
                    assert "demo: OK" in out.stdout
                if "ray job submit" in command:
                    assert "succeeded" in out.stdout + out.stderr
                    # a job log is no terminal: plain progress lines (osvl/logs.py) instead of a bar
                    done = re.search(r"osvl\.logs: synthesize: (\d+)/\1 shards \(100%\)", out.stdout)
                    assert done, out.stdout[-3000:]
        finally:
            if cleanup and cleanup not in ran:
                subprocess.run(["bash", "-c", cleanup], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert "make demo" in ran and "make ray-up" in ran
