"""The chat format of docs/design.md: special tokens, rendering, parsing, format check.

This module is the single source of truth for how a conversation becomes text.
SFT, RL, eval and serving all render through ``render`` (or ``CHAT_TEMPLATE``, its
Jinja twin for Hugging Face processors and vLLM), and every assistant turn is read
back with ``parse_turn``. It imports nothing heavy so ``import osvl`` stays light.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from typing import Any, Literal

from osvl.errors import TOOL_ERROR_KINDS, DataError, ParseError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Qwen3-VL vision tokens: one image renders as VISION_START IMAGE_PAD VISION_END and the
# processor later expands the single IMAGE_PAD to as many pads as the image has patches.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_TOKENS = VISION_START + IMAGE_PAD + VISION_END

SPECIAL_TOKENS = [
    IM_START, IM_END,
    THINK_OPEN, THINK_CLOSE,
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE,
    RESPONSE_OPEN, RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE,
    VISION_START, IMAGE_PAD, VISION_END,
]
"""Every string the tokenizer must keep as one token."""

STOP_STRINGS = (TOOL_CALL_CLOSE, RESPONSE_CLOSE)
"""Generation stops after either action closes; the loop then appends ``<|im_end|>``."""

# ---------------------------------------------------------------------------
# system prompt: fixed text around the tool schemas, shared with CHAT_TEMPLATE so the
# two renderings cannot drift apart.

_SYSTEM_HEAD = (
    "You are a multimodal deep-search agent. Answer the user's question about the image(s): "
    "reason step by step, inspect the images and search for facts with the tools, then answer.\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one of these functions per turn; their JSON schemas:\n"
    "<tools>\n"
)
_SYSTEM_TAIL = (
    "</tools>\n"
    "\n"
    "# Format\n"
    "\n"
    "Every turn of yours is <think>your reasoning</think> followed by exactly one of\n"
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
    "<response>your final answer</response>\n"
    "Images are named img_1, img_2, ... in order of appearance. Pass an image by its name "
    '(for example "image": "img_1") and give coordinates in that image\'s own pixels. '
    "A tool's result comes back inside <tool_response></tool_response>, followed by any new images; "
    "a failed call comes back as Error (<kind>): <message>."
)


# The Jinja twin of ``render``. Every tag trims the whitespace around it ({%- -%}), so the
# layout below is for reading only and the output does not depend on the trim_blocks /
# lstrip_blocks settings of whoever renders it (Hugging Face, vLLM). All literal text is
# spliced in from this module's constants as [[NAME]] -> a Jinja string literal, and
# ``tojson`` is the Hugging Face filter (json.dumps with ensure_ascii=False), as in
# ``system_prompt``.
_TEMPLATE = r"""
{%- set ns = namespace(first=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.first = 1 -%}
{%- endif -%}
{%- if tools -%}
    {{- [[IM_START]] + 'system\n' -}}
    {%- if ns.first == 1 -%}
        {{- messages[0]['content'] + '\n\n' -}}
    {%- endif -%}
    {{- [[SYSTEM_HEAD]] -}}
    {%- for tool in tools -%}
        {{- (tool | tojson) + '\n' -}}
    {%- endfor -%}
    {{- [[SYSTEM_TAIL]] + [[IM_END]] + '\n' -}}
{%- elif ns.first == 1 -%}
    {{- [[IM_START]] + 'system\n' + messages[0]['content'] + [[IM_END]] + '\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
    {%- if message['role'] == 'user' -%}
        {{- [[IM_START]] + 'user\n' -}}
        {%- for name in message['images'] or [] -%}
            {{- [[IMAGE]] + name + '\n' -}}
        {%- endfor -%}
        {{- message['content'] + [[IM_END]] + '\n' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- [[IM_START]] + 'user\n' + [[TOOL_RESPONSE_OPEN]] + '\n' + message['content'] -}}
        {{- '\n' + [[TOOL_RESPONSE_CLOSE]] -}}
        {%- for name in message['images'] or [] -%}
            {{- '\n' + [[IMAGE]] + name -}}
        {%- endfor -%}
        {{- [[IM_END]] + '\n' -}}
    {%- else -%}
        {{- [[IM_START]] + 'assistant\n' + message['content'] + [[IM_END]] + '\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- [[IM_START]] + 'assistant\n' -}}
{%- endif -%}
"""
CHAT_TEMPLATE = _TEMPLATE.strip()
for _name, _text in {"IM_START": IM_START, "IM_END": IM_END, "IMAGE": IMAGE_TOKENS, "SYSTEM_HEAD": _SYSTEM_HEAD,
                     "SYSTEM_TAIL": _SYSTEM_TAIL, "TOOL_RESPONSE_OPEN": TOOL_RESPONSE_OPEN,
                     "TOOL_RESPONSE_CLOSE": TOOL_RESPONSE_CLOSE}.items():
    CHAT_TEMPLATE = CHAT_TEMPLATE.replace(f"[[{_name}]]", json.dumps(_text))
"""Hugging Face chat template that renders exactly what ``render`` renders (set it on every processor)."""

ROLES = ("system", "user", "assistant", "tool")


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system turn's text: the format rules around one JSON schema per line.

    Schemas are OpenAI style (``{"type": "function", "function": {...}}``) and are
    dumped with ``json.dumps(..., ensure_ascii=False)``, which is exactly what the
    ``tojson`` filter of Hugging Face chat templates produces.
    """
    if not isinstance(tools, list | tuple) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"tools must be a list of JSON-schema dicts, got {tools!r}")
    lines = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return _SYSTEM_HEAD + lines + _SYSTEM_TAIL


def _check_messages(messages: list[dict[str, Any]]) -> None:
    """Reject what ``render`` (and so the template) cannot render faithfully."""
    if not isinstance(messages, list | tuple):
        raise DataError(f"messages must be a list of dicts, got {type(messages).__name__}")
    n_images = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"message {i} is not a dict: {m!r}")
        role, content, images = m.get("role"), m.get("content"), m.get("images") or []
        if role not in ROLES:
            raise DataError(f"message {i}: role must be one of {ROLES}, got {role!r}")
        if role == "system" and i != 0:
            raise DataError(f"message {i}: a system message may only come first")
        if not isinstance(content, str):
            raise DataError(f"message {i}: content must be a str, got {type(content).__name__}")
        if not isinstance(images, list | tuple) or not all(isinstance(x, str) for x in images):
            raise DataError(f"message {i}: images must be a list of image names, got {images!r}")
        if images and role not in ("user", "tool"):
            raise DataError(f"message {i}: only user and tool messages carry images, not {role!r}")
        # Names follow order of appearance so that "img_k" in a tool call means the same
        # image to the model, the executor and the trajectory record.
        for name in images:
            n_images += 1
            if name != f"img_{n_images}":
                raise DataError(f"message {i}: image {name!r} should be named 'img_{n_images}' "
                                "(images are numbered in order of appearance)")


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False) -> str:
    """ChatML text of a conversation, byte for byte what ``CHAT_TEMPLATE`` renders.

    ``tools`` (when non-empty) makes the system turn ``system_prompt(tools)``; a leading
    system message is then put before it, separated by a blank line, rather than
    replacing it, so a teacher's instructions never lose the tool list. A "tool" message
    renders as a user turn wrapped in ``<tool_response>``. Malformed messages, and images
    not named ``img_1, img_2, ...`` in order of appearance, raise ``DataError``.
    """
    _check_messages(messages)
    out = []
    body = list(messages)
    system = body.pop(0)["content"] if body and body[0]["role"] == "system" else None
    if tools:
        prompt = system_prompt(list(tools))
        out.append(f"{IM_START}system\n{system + chr(10) * 2 if system is not None else ''}{prompt}{IM_END}\n")
    elif system is not None:
        out.append(f"{IM_START}system\n{system}{IM_END}\n")
    for m in body:
        images = m.get("images") or []
        if m["role"] == "user":
            pics = "".join(f"{IMAGE_TOKENS}{name}\n" for name in images)
            out.append(f"{IM_START}user\n{pics}{m['content']}{IM_END}\n")
        elif m["role"] == "tool":
            pics = "".join(f"\n{IMAGE_TOKENS}{name}" for name in images)
            out.append(f"{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}{pics}{IM_END}\n")
        else:
            out.append(f"{IM_START}assistant\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


# ---------------------------------------------------------------------------
# builders: the only way osvl writes assistant and tool turns, so parse_turn reads them back.


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON with default separators)."""
    if not isinstance(name, str) or not name:
        raise DataError(f"tool name must be a non-empty str, got {name!r}")
    if not isinstance(arguments, dict):
        raise DataError(f"tool arguments must be a dict, got {type(arguments).__name__}")
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def assistant_text(think: str, *, tool_call: dict[str, Any] | None = None, response: str | None = None) -> str:
    """One assistant turn: ``<think>…</think>`` then a newline and exactly one action.

    ``tool_call`` is ``{"name": ..., "arguments": {...}}``. Texts that would end their
    own tag early (``</think>`` inside the thought, ``</response>`` inside the answer)
    are refused, since they could never be parsed back.
    """
    if (tool_call is None) == (response is None):
        raise DataError("an assistant turn has exactly one action: pass tool_call or response")
    if not isinstance(think, str) or THINK_CLOSE in think:
        raise DataError(f"think must be a str without {THINK_CLOSE!r}, got {think!r}")
    if response is not None:
        if not isinstance(response, str) or RESPONSE_CLOSE in response:
            raise DataError(f"response must be a str without {RESPONSE_CLOSE!r}, got {response!r}")
        action = f"{RESPONSE_OPEN}{response}{RESPONSE_CLOSE}"
    else:
        if not isinstance(tool_call, dict) or set(tool_call) != {"name", "arguments"}:
            raise DataError(f"tool_call must be {{'name': ..., 'arguments': {{...}}}}, got {tool_call!r}")
        action = tool_call_text(tool_call["name"], tool_call["arguments"])
    return f"{THINK_OPEN}{think}{THINK_CLOSE}\n{action}"


def tool_error_text(kind: str, message: str) -> str:
    """Content of the tool turn that answers a failed step: ``Error (<kind>): <message>``."""
    if kind not in TOOL_ERROR_KINDS:
        raise DataError(f"tool error kind must be one of {TOOL_ERROR_KINDS}, got {kind!r}")
    return f"Error ({kind}): {message}"


# ---------------------------------------------------------------------------
# parsing


@dataclasses.dataclass
class ParsedTurn:
    """One assistant turn read back: the thought and exactly one action."""

    think: str
    action: Literal["tool_call", "response"]
    name: str | None = None
    arguments: dict[str, Any] | None = None
    response: str | None = None


def _after_action(rest: str) -> None:
    """Whatever follows the action must be whitespace; say which rule it breaks if not."""
    if not rest.strip():
        return
    if TOOL_CALL_OPEN in rest or RESPONSE_OPEN in rest:
        raise ParseError("two_actions", "a turn has exactly one <tool_call> or <response>")
    raise ParseError("trailing_text", f"text after the action: {rest.strip()[:80]!r}")


def parse_turn(text: str, tool_names: Collection[str]) -> ParsedTurn:
    """Read one assistant turn strictly; every deviation is a ``ParseError`` with its kind.

    Tolerated: surrounding whitespace, a trailing ``<|im_end|>``, and whitespace between
    the thought and the action. The thought runs to the first ``</think>``, so it may
    mention any other tag. The tool-call JSON is decoded with ``raw_decode`` straight
    after ``<tool_call>`` rather than cut at the first ``</tool_call>``, so argument
    strings containing ``</tool_call>``, ``<`` or braces come back intact.
    """
    if isinstance(tool_names, str):  # "crop" would offer "c", "cr", ... through substring tests
        raise DataError(f"tool_names must be a collection of names, not the str {tool_names!r}")
    if not isinstance(text, str):
        raise ParseError("missing_tag", f"expected a str, got {type(text).__name__}")
    t = text.strip()
    if t.endswith(IM_END):
        t = t[: -len(IM_END)]  # whitespace left before it is trailing, which every branch below allows
    if not t.startswith(THINK_OPEN):
        if THINK_OPEN in t:
            raise ParseError("trailing_text", f"text before {THINK_OPEN}: {t[:t.index(THINK_OPEN)][:80]!r}")
        raise ParseError("missing_tag", f"the turn does not start with {THINK_OPEN}")
    think, closed, rest = t[len(THINK_OPEN):].partition(THINK_CLOSE)
    if not closed:
        raise ParseError("missing_tag", f"{THINK_OPEN} is never closed")
    rest = rest.lstrip()

    if rest.startswith(RESPONSE_OPEN):
        response, closed, after = rest[len(RESPONSE_OPEN):].partition(RESPONSE_CLOSE)
        if not closed:
            raise ParseError("missing_tag", f"{RESPONSE_OPEN} is never closed")
        _after_action(after)
        return ParsedTurn(think=think, action="response", response=response)

    if rest.startswith(TOOL_CALL_OPEN):
        body = rest[len(TOOL_CALL_OPEN):]
        start = len(body) - len(body.lstrip())
        try:
            call, stop = json.JSONDecoder().raw_decode(body, start)
        except json.JSONDecodeError as e:
            raise ParseError("no_json", f"tool call body is not JSON: {e}") from None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            raise ParseError("no_json", 'tool call must be {"name": ..., "arguments": {...}}')
        if not isinstance(call["name"], str) or not isinstance(call["arguments"], dict):
            raise ParseError("no_json", "tool call name must be a string and arguments an object")
        tail = body[stop:].lstrip()
        if not tail.startswith(TOOL_CALL_CLOSE):
            if TOOL_CALL_CLOSE in tail:
                raise ParseError("no_json", f"text after the JSON inside {TOOL_CALL_OPEN}")
            raise ParseError("missing_tag", f"{TOOL_CALL_OPEN} is never closed")
        _after_action(tail[len(TOOL_CALL_CLOSE):])
        if call["name"] not in tool_names:
            raise ParseError("unknown_tool", f"no tool named {call['name']!r}; offered: {sorted(tool_names)}")
        return ParsedTurn(think=think, action="tool_call", name=call["name"], arguments=call["arguments"])

    if TOOL_CALL_OPEN in rest or RESPONSE_OPEN in rest:
        raise ParseError("trailing_text", f"text between {THINK_CLOSE} and the action: {rest[:80]!r}")
    raise ParseError("missing_tag", f"no {TOOL_CALL_OPEN} or {RESPONSE_OPEN} after {THINK_CLOSE}")


def format_score(text: str, tool_names: Collection[str]) -> float:
    """1.0 when the turn parses, else 0.0: the per-turn score that r_fmt averages."""
    try:
        parse_turn(text, tool_names)
    except ParseError:
        return 0.0
    return 1.0
