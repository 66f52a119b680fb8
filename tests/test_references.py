"""Every reference to a repository file, in the docs and in the code, names a file that exists.

Docs and docstrings point readers at files (``docs/design.md``, ``serve/app.py``,
``configs/grpo/demo.yaml``) and at modules (``osvl.agent.fatal.mask_start``); when a file
moves, these are the references nothing else checks, and they rot silently. Scanned:

- every Markdown file: its links (``[text](target)``, relative to the file) and its
  backticked paths;
- every text file of the repository (code, configs, Makefile, CI): repository paths
  (``docs/x.md``, ``osvl/y.py``...) in docstrings, comments and help texts;
- everywhere: dotted ``osvl.`` module references, which must name a module or package,
  optionally followed by a name that module defines.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("osvl", "jobs", "serve", "docs", "configs", "deploy", "bench", "tests", "dashboards", ".ci")
EXT = r"(?:py|md|yaml|yml|json|toml|txt|sh|png|cfg|jinja)"
# a repository path: a top-level folder, then path segments, ending in a known extension or a slash
REPO_PATH = re.compile(rf"(?<![\w./<>{{}}-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./-]*?(?:\.{EXT}\b|/))")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACKTICKED = re.compile(r"`([^`\s]+)`")
MODULE_REF = re.compile(r"(?<![\w./-])osvl(?:\.[A-Za-z_]\w*)+")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".json", ""}


def repo_files() -> list[Path]:
    """Tracked and new (not ignored) files: a fresh clone's view, never runs/ or the venv."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [REPO / p for p in out if p and (REPO / p).is_file()]


def text_files() -> list[Path]:
    files = []
    for p in repo_files():
        # this file plants broken references on purpose; the KG sample is data, not prose
        if (p.suffix in TEXT_SUFFIXES and p != Path(__file__).resolve() and "sample" not in p.relative_to(REPO).parts
                and p.stat().st_size < 2_000_000):
            try:
                p.read_text()
            except UnicodeDecodeError:
                continue
            files.append(p)
    return files


def _placeholder(path: str) -> bool:
    """A pattern or a template, not one file: ``part-NNNNN.parquet``, ``<run>/x``, ``*.yaml``, ``{name}``,
    ``jobs/X.py``, ``jobs/NAME.py``; or a machine's own folder such as ``osvl/.venv/`` (never in the repo)."""
    return (any(c in path for c in "*<>{}$") or "NNN" in path or "..." in path
            or re.search(r"/(?:[A-Z]|NAME)?\.\w+$|/\.", path) is not None)


def _exists(path: str, base: Path) -> bool:
    path = path.split("#")[0].rstrip("/")
    return (base / path).exists() or (REPO / path).exists()


def _module_exists(ref: str, defined: dict[Path, str]) -> bool:
    """``osvl.a.b`` is a package or module, or ``osvl.a.b.name`` with ``name`` defined in ``osvl.a.b``."""
    parts = ref.split(".")
    for n in range(len(parts), 0, -1):
        stem = REPO.joinpath(*parts[:n])
        module = stem.with_suffix(".py") if stem.with_suffix(".py").is_file() else stem / "__init__.py"
        if not module.is_file():
            continue
        if n == len(parts):
            return True
        text = defined.setdefault(module, module.read_text())
        if parts[n].startswith("__"):  # osvl.__file__, osvl.__version__
            return True
        name = re.escape(parts[n])
        return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b"
                         rf"|^\s*(?:from\s+\S+\s+)?import\s+\(?[^)]*\b{name}\b", text, re.MULTILINE) is not None
    return False


def broken_in(f: Path, text: str, defined: dict[Path, str]) -> set[str]:
    """The references of one file (at ``f``, holding ``text``) that name nothing in the repository."""
    rel = f.relative_to(REPO)
    refs: list[tuple[str, Path]] = []
    if f.suffix == ".md":
        for target in MD_LINK.findall(text):
            if not re.match(r"^(?:[a-z]+:|#|/)", target):
                refs.append((target, f.parent))
        for token in BACKTICKED.findall(text):
            token = token.rstrip(".,:;")
            if re.fullmatch(rf"\w[\w./-]*\.{EXT}|\w[\w./-]*/", token) and "/" in token.rstrip("/"):
                # a repository path, or one relative to the Markdown file's folder
                if token.split("/")[0] in TOP or (f.parent / token.split("/")[0]).exists():
                    refs.append((token, f.parent))
    if rel.parts[0] != "tests":  # tests name the files of their own fixtures, under tmp_path
        refs += [(m, REPO) for m in REPO_PATH.findall(text)]
    broken = {f"{rel}: {path}" for path, base in refs if not _placeholder(path) and not _exists(path, base)}
    broken |= {f"{rel}: {ref}" for ref in MODULE_REF.findall(text) if not _module_exists(ref, defined)}
    return broken


def test_every_reference_to_a_repository_file_exists():
    defined: dict[Path, str] = {}
    broken = sorted(b for f in text_files() for b in broken_in(f, f.read_text(), defined))
    assert broken == []


def test_the_check_finds_a_broken_reference():
    """The scan is not vacuous: a doc naming a missing file, a missing module and a missing name fails it."""
    doc = REPO / "docs" / "planted.md"
    text = ("See [the plan](missing-plan.md), [the design](design.md), `osvl/agent/nowhere.py`, "
            "`osvl/agent/fatal.py`, ``osvl.rl.fatal`` and ``osvl.agent.fatal.no_such_name``; "
            "``osvl.agent.fatal.mask_start`` exists.\n")
    assert sorted(broken_in(doc, text, {})) == [f"docs/planted.md: {r}" for r in sorted(
        ["missing-plan.md", "osvl/agent/nowhere.py", "osvl.agent.fatal.no_such_name", "osvl.rl.fatal"])]


def test_no_reference_to_the_old_design_file():
    name = "ARCHITECTURE" + ".md"  # spelled in two parts so this file does not match itself
    hits = subprocess.run(["git", "grep", "-l", name], cwd=REPO, capture_output=True, text=True)
    assert hits.stdout == "", hits.stdout
