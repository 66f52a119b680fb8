"""One function builds the agent's environment (``osvl.agent.env.build_env``), and nothing else does.

Statically: no module of osvl/, serve/ or jobs/ but ``osvl/agent/env.py`` calls what builds an engine,
a tool client or a search backend (the scanner resolves each call through the module's imports, so
``osvl.rl.learner``'s DeepSpeed ``make_engine`` is not ``osvl.agent.engines.make_engine``, and a class's
own module may call it). Behaviourally: two environments in one process with different search settings
search with their own, and a tool that was handed no backend says so instead of using a default.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("osvl", "serve", "jobs")
HOME = "osvl/agent/env.py"

BUILDERS = {
    # engines
    "osvl.agent.engines.make_engine", "osvl.agent.engines.hf.HFEngine", "osvl.agent.engines.vllm.VLLMEngine",
    "osvl.agent.engines.openai.OpenAIChatEngine",
    # tool clients and their transports
    "osvl.tools.client.make_client", "osvl.tools.client.ToolClient", "osvl.tools.client.InProcessTransport",
    "osvl.tools.client.CachedInProcess", "osvl.tools.client.HandleTransport", "osvl.tools.client.HttpTransport",
    # search backends
    "osvl.tools.text_search.build_text_index", "osvl.tools.text_search.TextIndex",
    "osvl.tools.image_search.build_image_index", "osvl.tools.image_search.ImageIndex",
    "osvl.tools.web.WebSearch", "osvl.tools.base.LazyBackend",
}
"""What builds a part of the environment: called anywhere but ``HOME`` it is a second environment."""

FACTORIES = {"osvl/agent/engines/__init__.py": {"osvl.agent.engines.hf.HFEngine", "osvl.agent.engines.vllm.VLLMEngine"}}
"""``make_engine`` is itself the factory of the engine classes it imports."""

PENDING: set[tuple[str, str]] = set()
"""Call sites in files that were being moved when ``build_env`` came, each to move to it; an entry that no
longer matches a call fails the test, so that it is removed with the move."""


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_bindings(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import of the module (function-local ones too)."""
    package = module if is_package else module.rpartition(".")[0]
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # ``import a.b.c`` binds ``a``
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def dotted(expr: ast.AST, names: dict[str, str]) -> str:
    """What ``expr`` names through the module's imports; "" for anything not reached from an import."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id, "")
    if isinstance(expr, ast.Attribute):
        base = dotted(expr.value, names)
        return f"{base}.{expr.attr}" if base else ""
    return ""


def builder_calls(source: str, path: str) -> list[tuple[int, str]]:
    """(line, builder) of every call in ``source`` (the file at repo-relative ``path``) that builds an engine,
    a tool client or a search backend: a call of a ``BUILDERS`` name, or of a class method of one
    (``TextIndex.build``, ``TextIndex.load``)."""
    tree = ast.parse(source, filename=path)
    names = import_bindings(tree, module_name(path), path.endswith("__init__.py"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func, names)
            for candidate in (name, name.rpartition(".")[0]):
                if candidate in BUILDERS and candidate not in FACTORIES.get(path, ()):
                    found.append((node.lineno, candidate))
                    break
    return sorted(found)


def scan() -> dict[str, list[tuple[int, str]]]:
    """Repo-relative path -> its builder calls, for every Python file under ``SCANNED``."""
    out = {}
    for root in SCANNED:
        for file in sorted((REPO / root).rglob("*.py")):
            path = file.relative_to(REPO).as_posix()
            calls = builder_calls(file.read_text(), path)
            if calls:
                out[path] = calls
    return out


def test_engines_tool_clients_and_search_backends_are_built_only_by_build_env():
    found = scan()
    home = {b for _, b in found.pop(HOME, [])}
    # the scanner sees the builders where they are meant to be called (it is not blind)
    assert {"osvl.agent.engines.make_engine", "osvl.tools.client.make_client", "osvl.tools.base.LazyBackend",
            "osvl.tools.text_search.build_text_index", "osvl.tools.image_search.build_image_index"} <= home
    elsewhere = [(path, line, b) for path, calls in found.items() for line, b in calls]
    pending = {(path, b) for path, _, b in elsewhere if (path, b) in PENDING}
    assert pending == PENDING, f"stale PENDING entries (the call moved to build_env): {sorted(PENDING - pending)}"
    offenders = [f"{path}:{line}: {b}" for path, line, b in elsewhere if (path, b) not in PENDING]
    assert not offenders, "build these through osvl.agent.env.build_env:\n" + "\n".join(offenders)


def test_the_scanner_catches_a_new_call_site_however_it_is_imported():
    planted = {
        "from osvl.agent.engines import make_engine\ne = make_engine('hf', 'ckpt')\n": "osvl.agent.engines.make_engine",
        "from osvl.tools import client\nc = client.ToolClient(transport)\n": "osvl.tools.client.ToolClient",
        "import osvl.tools.client\nc = osvl.tools.client.make_client('inprocess')\n": "osvl.tools.client.make_client",
        "from osvl.tools import text_search as ts\ni = ts.TextIndex.build([], ts.TextSearchConfig())\n":
            "osvl.tools.text_search.TextIndex",
        "def f():\n    from osvl.tools.image_search import build_image_index as b\n    return b()\n":
            "osvl.tools.image_search.build_image_index",
        "from ..tools.web import WebSearch\nw = WebSearch()\n": "osvl.tools.web.WebSearch",
    }
    for source, builder in planted.items():
        assert [b for _, b in builder_calls(source, "osvl/rl/planted.py")] == [builder], source
    # not a builder: the learner's DeepSpeed make_engine, a module's own function of the same name
    assert builder_calls("from osvl.rl.learner import make_engine\ne = make_engine(m, cfg)\n", "osvl/rl/x.py") == []
    assert builder_calls("def make_engine():\n    pass\nmake_engine()\n", "osvl/rl/x.py") == []
    # a factory may build what it makes; the same call elsewhere is a builder call
    own = "from osvl.agent.engines.hf import HFEngine\nHFEngine('m')\n"
    assert builder_calls(own, "osvl/agent/engines/__init__.py") == []
    assert builder_calls(own, "osvl/eval/x.py") == [(2, "osvl.agent.engines.hf.HFEngine")]


def _kg(folder: Path, entities: list[dict]) -> str:
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(entities), folder / "entities.parquet")
    return str(folder)


def _entity(i: int, title: str, text: str) -> dict:
    return {"id": i, "title": title, "aliases": [], "description": "", "text": text, "attributes": [],
            "categories": []}


def test_two_envs_in_one_process_search_with_their_own_settings(tmp_path, monkeypatch):
    from osvl.agent.env import build_env
    from osvl.tools import image_search, text_search
    from osvl.tools.text_search import TextSearchConfig

    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    towers = _kg(tmp_path / "towers", [_entity(1, "Eiffel Tower", "A wrought-iron lattice tower in Paris. " * 8),
                                       _entity(2, "Tokyo Tower", "A lattice tower in Tokyo painted white and orange.")])
    rivers = _kg(tmp_path / "rivers", [_entity(1, "Seine", "A river that flows through Paris to the sea."),
                                       _entity(2, "Thames", "A river in England.")])
    short = build_env(text_search=TextSearchConfig(kg_dir=towers, snippet_chars=40))
    long = build_env(text_search=TextSearchConfig(kg_dir=towers, snippet_chars=300))
    other = build_env(text_search=TextSearchConfig(kg_dir=rivers))
    assert not hasattr(text_search, "DEFAULT") and not hasattr(text_search, "configure")
    assert not hasattr(image_search, "DEFAULT") and not hasattr(image_search, "configure")

    async def hits(env) -> list[dict]:
        result = await env.client.call("text_search", {"query": "Paris", "top_k": 5})
        assert result.ok, result.text
        return result.data["hits"]

    # interleaved: a setting of one env must not leak into the next call of another
    got = {name: asyncio.run(hits(env)) for name, env in [("short", short), ("other", other), ("long", long)]}
    assert [h["title"] for h in got["short"]] == [h["title"] for h in got["long"]] == ["Eiffel Tower"]
    assert [h["title"] for h in got["other"]] == ["Seine"]
    assert len(got["short"][0]["snippet"]) <= 42 < len(got["long"][0]["snippet"])
    assert short.search["text_search"] is not long.search["text_search"]
    assert short.search["text_search"].backend_id != long.search["text_search"].backend_id
    # an env given another's backends shares them (one index per worker); nothing else does
    assert build_env(search=short.search).search["text_search"] is short.search["text_search"]


def test_a_search_tool_without_a_backend_fails_and_names_the_fix():
    from osvl.tools.base import ToolContext, call_tool
    from osvl.tools.registry import all_tools

    for name, args in (("text_search", {"query": "Eiffel Tower"}), ("image_search", {"image": "img_1"})):
        ctx = ToolContext({"img_1": np.zeros((8, 8, 3), np.uint8)})
        result = call_tool(all_tools()[name], args, ctx)
        assert result.error is not None and result.error.kind == "tool_error", result
        assert "osvl.agent.env" in result.text


def test_a_search_backend_is_built_on_its_first_search_only(tmp_path, monkeypatch):
    """An env whose episodes never search never loads an index (a rollout actor offering image tools only)."""
    from osvl.agent.env import build_env
    from osvl.tools.text_search import TextSearchConfig

    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    env = build_env(text_search=TextSearchConfig(kg_dir=str(tmp_path / "no_such_kg")))
    result = asyncio.run(env.client.call("crop", {"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4},
                                         {"img_1": np.zeros((8, 8, 3), np.uint8)}))
    assert result.ok and env.search["text_search"]._obj is None  # a missing KG is not even noticed
    failed = asyncio.run(env.client.call("text_search", {"query": "x"}))
    assert failed.error.kind == "tool_error" and "does not exist" in failed.text
