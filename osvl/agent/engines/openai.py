"""A ``ChatEngine`` over any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, hosted APIs).

Used for teachers (a large VLM writes expert turns) and judges (the answer and process
judges send text-only prompts through the same client). The conversation is sent as the
student would see it, in osvl's chat format: assistant turns verbatim, tool answers as
user turns wrapped in ``<tool_response>``, and every image as a PNG data URL right before
its ``img_k`` name, so a teacher reads exactly the layout the student is trained on.

Why no ``stop`` parameter: servers drop the stop string from the reply (and vLLM's option
to keep it is not part of the OpenAI protocol), so the engine instead cuts the reply after
the first ``</tool_call>`` or ``</response>``: one turn, one action.

Requests go through ``osvl.endpoint.ChatClient`` (retries with backoff, then
``EndpointUnavailable``; a configuration mistake raises ``ConfigError`` at once), the one
client every OpenAI-compatible caller in osvl uses.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from osvl.agent.engines.base import Sampling
from osvl.agent.trajectory import png_bytes
from osvl.chat import IMAGE_TOKENS, STOP_STRINGS, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, system_prompt
from osvl.endpoint import ChatClient, EndpointConfig


def image_data_url(arr: np.ndarray) -> str:
    """RGB uint8 array -> ``data:image/png;base64,...`` (lossless: the teacher sees the student's pixels)."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(arr)).decode("ascii")


def to_openai_messages(messages: list[dict[str, Any]], images: Mapping[str, np.ndarray],
                       tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """osvl messages (role/content/images) -> OpenAI chat messages with images as data URLs.

    ``tools`` puts osvl's system prompt (the schemas and format rules) first, after any
    system message of the caller, as ``render`` does.
    """
    out: list[dict[str, Any]] = []
    body = list(messages)
    system = body.pop(0)["content"] if body and body[0]["role"] == "system" else None
    if tools:
        prompt = system_prompt(list(tools))
        out.append({"role": "system", "content": f"{system}\n\n{prompt}" if system is not None else prompt})
    elif system is not None:
        out.append({"role": "system", "content": system})
    for m in body:
        names = list(m.get("images") or [])
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": m["content"]})
            continue
        if m["role"] == "tool":
            text = f"{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}"
            parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
            for name in names:
                parts += [{"type": "image_url", "image_url": {"url": image_data_url(images[name])}},
                          {"type": "text", "text": name}]
        else:
            parts = []
            for name in names:
                parts += [{"type": "image_url", "image_url": {"url": image_data_url(images[name])}},
                          {"type": "text", "text": name + "\n"}]
            parts.append({"type": "text", "text": m["content"]})
        if len(parts) == 1:  # text only: plain string content, which every server accepts
            out.append({"role": "user", "content": parts[0]["text"]})
        else:
            out.append({"role": "user", "content": parts})
    return out


def cut_after_action(text: str) -> str:
    """The reply up to and including its first ``</tool_call>`` or ``</response>`` (one turn, one action)."""
    ends = [text.find(s) + len(s) for s in STOP_STRINGS if s in text]
    out = text[:min(ends)] if ends else text
    return out.replace(IMAGE_TOKENS, "").strip()


class OpenAIChatEngine:
    """Messages in, one assistant turn out, over HTTP with retries (see the module docstring)."""

    def __init__(self, cfg: EndpointConfig, tools: list[dict[str, Any]] | None = None, cut: bool = True) -> None:
        self.client = ChatClient(cfg)
        self.cfg = cfg
        self.tools = tools
        self.cut = cut
        self.name = f"openai:{cfg.model}"
        self.stats = self.client.stats

    async def complete(self, openai_messages: list[dict[str, Any]], sampling: Sampling) -> str:
        """One chat completion (already OpenAI-shaped messages); retries, then ``EndpointUnavailable``."""
        return await self.client.complete(openai_messages, sampling.temperature, sampling.max_new_tokens,
                                          sampling.seed)

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Sampling) -> str:
        text = await self.complete(to_openai_messages(messages, images, self.tools), sampling)
        return cut_after_action(text) if self.cut else text

    async def close(self) -> None:
        await self.client.close()
