"""Every tool, registered: importing this module imports each tool module once.

Kept apart from ``osvl/tools/__init__.py`` so ``import osvl.tools`` stays light:
the image tool modules import only NumPy at module level and load OpenCV, SciPy,
torch, basicsr or RapidOCR inside the call that needs them; search tools build
their backends lazily from ``ctx.options`` or their own config.

The search tools live in modules owned by another part of the project; while a
module file does not exist yet, its tools are absent from ``all_tools()`` (and
``missing_tools()`` names them) instead of breaking every importer. A module
that exists but fails to import raises as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from osvl.errors import ConfigError
from osvl.tools import crop, ocr, perspective, sharpen, super_resolution  # noqa: F401
from osvl.tools.base import REGISTRY, Tool

TOOL_NAMES = ("crop", "sharpen", "super_resolution", "perspective_correct", "ocr", "text_search", "image_search")
"""The OpenSearch-VL tool set, in the order the system prompt lists them."""

for _module in ("osvl.tools.text_search", "osvl.tools.image_search"):
    if importlib.util.find_spec(_module) is not None:
        importlib.import_module(_module)


def all_tools() -> dict[str, Tool]:
    """name -> Tool for every registered tool of the set, in ``TOOL_NAMES`` order."""
    return {n: REGISTRY[n] for n in TOOL_NAMES if n in REGISTRY}


def missing_tools() -> list[str]:
    """Tools of the OpenSearch-VL set that no imported module registered."""
    return [n for n in TOOL_NAMES if n not in REGISTRY]


def offered_tools(names: list[str], schema_file: str = "") -> list[dict[str, Any]]:
    """JSON schemas of the tools the policy is offered (all registered ones when ``names`` is empty),
    from the registry or from ``schema_file``; every offered name must be a registered tool."""
    tools = all_tools()
    schemas = ([t.schema for t in tools.values()] if not schema_file
               else json.loads(Path(schema_file).read_text()))
    by_name = {s["function"]["name"]: s for s in schemas}
    unknown = sorted((set(names) | set(by_name)) - set(tools))
    if unknown:
        raise ConfigError(f"rollout.offer/schemas: unknown tools {unknown}; registered: {sorted(tools)}")
    return [s for n, s in by_name.items() if not names or n in names]
