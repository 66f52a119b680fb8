"""A ``ChatEngine`` over any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, hosted APIs).

Used for teachers (a large VLM writes expert turns) and judges (the answer and process
judges send text-only prompts through the same client). The conversation is sent as the
student would see it, in osvl's chat format: assistant turns verbatim, tool answers as
user turns wrapped in ``<tool_response>``, and every image as a PNG data URL right before
its ``img_k`` name, so a teacher reads exactly the layout the student is trained on.

Why no ``stop`` parameter: servers drop the stop string from the reply (and vLLM's option
to keep it is not part of the OpenAI protocol), so the engine instead cuts the reply after
the first ``</tool_call>`` or ``</response>``: one turn, one action.

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried with exponential
backoff; after ``retries`` the engine raises ``EndpointUnavailable``, which callers turn
into an explicit state (a judge marks the sample, a teacher rollout is dropped and counted),
never a silent empty turn. Other HTTP errors (400, 401, 404) are configuration mistakes and
raise at once.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from osvl.agent.engines.base import Sampling
from osvl.chat import IMAGE_TOKENS, STOP_STRINGS, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, system_prompt
from osvl.config import opt
from osvl.errors import ConfigError, EndpointUnavailable

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass
class EndpointConfig:
    base_url: str = opt("", "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = opt("", "Model name sent in each request.")
    api_key_env: str = opt("", "Name of the environment variable holding the API key (never the key).",
                           hashed=False)
    timeout_s: float = opt(60.0, "Per-request timeout.", hashed=False)
    retries: int = opt(3, "Retries of a request that failed by connection, timeout, 429 or 5xx.", hashed=False)
    backoff_s: float = opt(0.5, "First retry delay; doubles per retry.", hashed=False)
    max_concurrency: int = opt(16, "Requests in flight per engine.", hashed=False)


def image_data_url(arr: np.ndarray) -> str:
    """RGB uint8 array -> ``data:image/png;base64,...`` (lossless: the teacher sees the student's pixels)."""
    from osvl.agent.trajectory import png_bytes

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
        if not cfg.base_url or not cfg.model:
            raise ConfigError("an OpenAI-compatible engine needs base_url and model")
        self.cfg = cfg
        self.tools = tools
        self.cut = cut
        self.name = f"openai:{cfg.model}"
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}
        self._sem: asyncio.Semaphore | None = None
        self._session: Any = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise ConfigError(f"api_key_env names {self.cfg.api_key_env!r}, which is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def complete(self, openai_messages: list[dict[str, Any]], sampling: Sampling) -> str:
        """One chat completion (already OpenAI-shaped messages); retries, then ``EndpointUnavailable``."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers())
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        body: dict[str, Any] = {"model": self.cfg.model, "messages": openai_messages,
                                "temperature": sampling.temperature, "max_tokens": sampling.max_new_tokens}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        url = self.cfg.base_url.rstrip("/") + "/chat/completions"
        self.stats["requests"] += 1
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            self.stats["attempts"] += 1
            try:
                async with self._sem, self._session.post(
                        url, json=body, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as resp:
                    status = resp.status
                    data = await resp.json(content_type=None) if status == 200 else await resp.text()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if status in _RETRY_STATUS:
                last = f"HTTP {status}: {str(data)[:200]}"
                continue
            if status != 200:
                raise ConfigError(f"{url} answered HTTP {status}: {str(data)[:300]}")
            try:
                return str(data["choices"][0]["message"]["content"] or "")
            except (KeyError, IndexError, TypeError):
                last = f"malformed completion: {str(data)[:200]}"
                continue
        self.stats["failures"] += 1
        raise EndpointUnavailable(f"{url}: no answer after {self.cfg.retries + 1} attempts ({last})")

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Sampling) -> str:
        text = await self.complete(to_openai_messages(messages, images, self.tools), sampling)
        return cut_after_action(text) if self.cut else text

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
