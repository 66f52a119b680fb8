"""The one OpenAI-compatible chat endpoint: its config section and its client.

Teachers, judges (``osvl.agent.engines.openai``), the LLM question rewriter
(``osvl.synth.rewrite``), the difficulty filter's no-tools model, the evaluation job's
``openai:NAME`` baselines and the web search's page summariser (``osvl.tools.web``) all
talk to ``POST {base_url}/chat/completions`` through ``ChatClient``, configured by one
``EndpointConfig`` section, so a timeout, a retry policy or an API-key rule is written,
documented and tested once.

Why not the ``openai`` package: it is a test-only dependency here, and what osvl needs is a
small subset (one POST, a bearer key, retries) on the aiohttp session the rest of the code
already uses.

Failures: connection errors, timeouts, HTTP 408, 429 and 5xx, and a 200 without
``choices[0].message.content`` are retried with exponential backoff (``backoff_s``, doubling);
after ``retries`` the client raises ``EndpointUnavailable``, which each caller turns into an
explicit state (a judge marks the sample, a teacher rollout is dropped and counted, a rewrite
keeps its template question). Other HTTP errors (400, 401, 404) are configuration mistakes
and raise ``ConfigError`` at once, as does an ``api_key_env`` naming an unset variable.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from osvl.config import opt
from osvl.errors import ConfigError, EndpointUnavailable

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass
class EndpointConfig:
    """An OpenAI-compatible chat endpoint; where and what change results (hashed), how patiently does not."""

    base_url: str = opt("", "OpenAI-compatible base URL, up to /v1, e.g. http://127.0.0.1:8000/v1.")
    model: str = opt("", "Model name sent in each request.")
    api_key_env: str = opt("", "Name of the environment variable holding the API key, sent as a bearer token "
                               "(never the key itself); empty = no key.", hashed=False)
    timeout_s: float = opt(60.0, "Deadline of one request (one attempt), seconds.", hashed=False)
    retries: int = opt(3, "Retries of a request that failed by connection, timeout, HTTP 408/429/5xx or a "
                          "malformed answer; then EndpointUnavailable.", hashed=False)
    backoff_s: float = opt(0.5, "Delay before the first retry, seconds; doubles with each further retry.",
                           hashed=False)
    max_concurrency: int = opt(16, "Requests in flight per client.", hashed=False)

    def check(self, what: str = "endpoint") -> None:
        """``what`` names the section in the error (``rewriter.endpoint``, ``judge``, ...)."""
        if not self.base_url or not self.model:
            raise ConfigError(f"{what} needs base_url and model (--{what}.base_url=http://host:port/v1 "
                              f"--{what}.model=NAME)")
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0 or self.max_concurrency < 1:
            raise ConfigError(f"{what}: retries and backoff_s must be >= 0, timeout_s > 0, max_concurrency >= 1")


class ChatClient:
    """``complete(messages, ...)`` -> the reply's text, with retries and backoff (see the module docstring).

    One client per event loop: the aiohttp session is opened on the first request and bound to
    that loop; ``close()`` it when done.
    """

    def __init__(self, cfg: EndpointConfig, what: str = "endpoint") -> None:
        cfg.check(what)
        self.cfg, self.what = cfg, what
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}
        self._sem: asyncio.Semaphore | None = None
        self._session: Any = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise ConfigError(f"{self.what}.api_key_env names {self.cfg.api_key_env!r}, which is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def complete(self, messages: list[dict[str, Any]], temperature: float, max_tokens: int | None = None,
                       seed: int | None = None) -> str:
        """One chat completion of OpenAI-shaped ``messages``; retries, then ``EndpointUnavailable``."""
        import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers())
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        body: dict[str, Any] = {"model": self.cfg.model, "messages": messages, "temperature": temperature}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:
            body["seed"] = seed
        self.stats["requests"] += 1
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            self.stats["attempts"] += 1
            try:
                async with self._sem, self._session.post(
                        self.url, json=body, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as resp:
                    status = resp.status
                    data = await resp.json(content_type=None) if status == 200 else await resp.text()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if status in RETRY_STATUS:
                last = f"HTTP {status}: {str(data)[:200]}"
                continue
            if status != 200:
                raise ConfigError(f"{self.url} answered HTTP {status}: {str(data)[:300]}")
            try:
                return str(data["choices"][0]["message"]["content"] or "")
            except (KeyError, IndexError, TypeError):
                last = f"malformed completion: {str(data)[:200]}"
                continue
        self.stats["failures"] += 1
        raise EndpointUnavailable(f"{self.url}: no answer after {self.cfg.retries + 1} attempts ({last})")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
