"""The package layering of pyproject.toml's import-linter contract, and no import cycle.

Both checks run on a copy of ``osvl/`` (only its ``.py`` files) so a violation can be
planted without touching the tree: ``lint-imports`` with the project's own config must
pass on the clean copy and fail, naming the contract and the import, once one module
imports a layer above it. import-linter cannot see a cycle inside one layer
(``osvl.agent.loop`` <-> ``osvl.agent.trajectory`` would keep the contract), so a second
check finds the strongly connected components of the module graph with grimp.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# Module-level import cycles of the package found under PYTHONPATH (printed as JSON). Imports under
# ``if TYPE_CHECKING:`` are left out: they never run, so they cannot make an import order fail.
CYCLES = """
import json, sys
import grimp
g = grimp.build_graph("osvl", cache_dir=None, exclude_type_checking_imports=True)
adj = {m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}
index, low, stack, on, found = {}, {}, [], set(), []
sys.setrecursionlimit(10_000)
def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v); on.add(v)
    for w in adj[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while not comp or comp[-1] != v:
            comp.append(stack.pop()); on.discard(comp[-1])
        if len(comp) > 1:
            found.append(sorted(comp))
for m in sorted(adj):
    if m not in index:
        visit(m)
print(json.dumps(found))
"""


def _copy_package(dest: Path) -> Path:
    """``osvl/`` with only its Python files (the data files are megabytes and import nothing)."""
    def skip(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if not (Path(folder, n).is_dir() or n.endswith(".py")) or n == "__pycache__"]

    shutil.copytree(REPO / "osvl", dest / "osvl", ignore=skip)
    return dest


def _run(args: list[str], root: Path) -> subprocess.CompletedProcess:
    # the copy must win over the editable install, so it goes first on the path and nothing is cached
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _plant(root: Path, module: str, line: str) -> None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}  # planted\n")


def test_lint_imports_keeps_the_layers_and_fails_on_a_planted_violation(tmp_path):
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: install the dev extra (import-linter)")
    root = _copy_package(tmp_path)
    cmd = [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"]
    clean = _run(cmd, root)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "1 kept, 0 broken" in clean.stdout
    # the agent loop (agent layer) importing the learner (rl layer) breaks the contract, and so does the GRPO
    # stage importing SFT: RL, evaluation and SFT are siblings, only osvl.recipe chains them
    _plant(root, "osvl.agent.loop", "from osvl.rl import learner")
    _plant(root, "osvl.rl.job", "from osvl.sft import job as sft")
    broken = _run(cmd, root)
    assert broken.returncode != 0
    assert "osvl layers: each package imports only the layers below it BROKEN" in broken.stdout
    assert "osvl.agent.loop -> osvl.rl.learner" in broken.stdout
    assert "osvl.rl.job -> osvl.sft.job" in broken.stdout


def test_no_import_cycle(tmp_path):
    found = _run([sys.executable, "-c", CYCLES], REPO)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == []
    # the same check finds a cycle planted inside one layer, which the layers contract cannot see
    root = _copy_package(tmp_path)
    _plant(root, "osvl.agent.trajectory", "from osvl.agent import loop")
    planted = _run([sys.executable, "-c", CYCLES], root)
    assert planted.returncode == 0, planted.stderr
    assert ["osvl.agent.loop", "osvl.agent.trajectory"] in json.loads(planted.stdout)
