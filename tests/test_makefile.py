"""The Makefile installs once, skips when nothing changed, and reinstalls when a dependency changes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _dry_run(workdir: Path, venv: Path) -> str:
    out = subprocess.run(["make", "-n", "setup", f"VENV={venv}"], cwd=workdir, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture()
def project_copy(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def test_installed_venv_is_not_reinstalled(project_copy: Path):
    venv = REPO / ".venv"
    if not any(venv.glob(".osvl-deps-*")):
        pytest.skip("the venv was not installed by make")
    assert "pip install" not in _dry_run(project_copy, venv)


def test_changed_dependency_triggers_reinstall(project_copy: Path):
    venv = REPO / ".venv"
    if not any(venv.glob(".osvl-deps-*")):
        pytest.skip("the venv was not installed by make")
    with open(project_copy / "constraints.txt", "a") as f:
        f.write("six==1.16.0\n")
    plan = _dry_run(project_copy, venv)
    assert "pip install" in plan and "-c constraints.txt" in plan


def test_fresh_checkout_creates_the_venv(project_copy: Path, tmp_path: Path):
    plan = _dry_run(project_copy, tmp_path / "new-venv")
    assert "-m venv" in plan and "torch==2.13.0" in plan and "--no-deps" in plan and "basicsr" in plan
