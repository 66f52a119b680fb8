"""The trained agent as an OpenAI-compatible service: ``POST /v1/chat/completions`` on Ray Serve.

A client sends what it would send any vision chat model: a user message whose content has
the question as text and the image as an ``image_url`` part (a ``data:image/...;base64,``
URL, or an http(s) URL when ``fetch_urls`` is on). The replica runs the whole agent loop
(``osvl.agent.loop.run_episode``) with its checkpoint, greedily unless the request sets a
temperature, offering the tools the checkpoint was trained with, and answers an ordinary
``chat.completion`` whose message content is the final answer, plus one extra top-level field,
``osvl_trajectory``:

    {"stop_reason": "response", "fatal": false, "events": [...],
     "turns": [{"text": ..., "action": "tool_call", "tool": "text_search", "arguments": {...},
                "status": "ok", "error_kind": "", "observation": "..."}, ...]}

One question per request: one user message, optionally after one system message (put before the
agent's own system prompt and tool list, as the evaluator's no-tools modes do); earlier assistant or
tool turns and several user messages are refused with a 400 (the agent answers one question and has
no memory of a conversation); text parts that are only an image name (``img_1``, as osvl's own
OpenAI engine writes them) are dropped. Request fields: ``model``, ``messages``, ``stream`` and
``stream_options``, ``temperature`` (honoured: 0 is greedy, the default), ``max_tokens`` /
``max_completion_tokens`` (honoured as the cap on tokens the agent generates in one turn), ``seed``
(the episode's sampling seed, modulo 2^31), ``n`` (1 only) and ``user`` (ignored); any other field is refused with a
400 naming it (``unsupported_field``).
Tools run through the tool app's Serve handles (``tools: handle``, the ``osvl_tools`` app of
``serve/app.py``) or in the replica (``inprocess``, searching with the config's ``text_search`` settings: set
them to the training run's ``rollout.text_search``). The replica's engine, tool client and search backend come
from ``osvl.agent.env.build_env``, as in training. One Serve instance has one HTTP port, so with
``tools: handle`` the two are two apps of it under distinct route prefixes: ``deploy`` starts the tool
app at ``tools_route_prefix`` (``/tools``: its API at ``http://127.0.0.1:PORT/tools/v1/tools``) unless
it already runs, then the agent at ``route_prefix`` (``/``).

``finish_reason`` (``FINISH_REASONS``): ``stop`` when the agent answered; ``length`` when a budget ran
out first (turns, tokens, or an image too large for the context); ``fatal`` (osvl's own value) when K
steps in a row failed (tool errors or unparsable calls: a fatal episode). The last two come with an
empty answer.

Streaming (``"stream": true``): Server-Sent Events in the Chat Completions chunk format. The first chunk
(``delta.role``) goes out before the episode starts; then one chunk per agent turn as soon as its tool
answered, with an empty delta and the turn in the extension field ``osvl_event``; then the answer in
content deltas; then a chunk with ``finish_reason``, ``usage`` and ``osvl_trajectory`` (its turns
already sent, so only stop reason, fatal flag and events); then ``data: [DONE]``. A client that
disconnects cancels the episode: its engine request is aborted (the HF engine drops the row at its next
step, vLLM aborts the request).

Security, the tool API's: it binds to 127.0.0.1 (``host`` moves it, and off loopback a token is
required: the service refuses to start without one), takes the same bearer token (the
variable named by ``token_env``; the tool API's check, imported), and image URLs are
fetched only with ``fetch_urls``, through the tools' SSRF guard (``osvl.tools.web``).
Bad requests get OpenAI-shaped errors (``{"error": {"type", "code", "message"}}``): 400
malformed / no question / no image / unreadable image / URL fetching off or refused, 401
token, 404 unknown model, 413 body or image too large; the replica stays healthy.

    python -m serve.agent_app --model=DIR --port=8001     # then any OpenAI client at http://127.0.0.1:8001/v1
    python -m serve.agent_app --tools=handle --port=8001  # and the tool API beside it at /tools
"""

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import os
import re
import sys
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from osvl.agent.engines import EngineKind
from osvl.agent.env import build_env
from osvl.agent.evaluate import trained_tools
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.scripted import agent_tools
from osvl.cluster import init_ray, start_serve
from osvl.config import from_dict, opt
from osvl.errors import FetchRefused, InvalidCall, OsvlError
from osvl.eval.job import resolve_model
from osvl.tools.client import MAX_PIXELS, decode_image
from osvl.tools.registry import offered_tools
from osvl.tools.text_search import TextSearchConfig
from osvl.tools.web import WebConfig, fetch_url
from serve.app import (
    SWALLOW_FACTOR,
    ServeConfig,
    ToolAPI,
    check_host,
    run_unless_running,
    serve_until_interrupted,
    service_flags,
)

AGENT_APP = "osvl_agent"
_NAME_ONLY = re.compile(r"^\s*img_\d+\s*$")
FINISH_REASONS = {"response": "stop", "max_turns": "length", "max_tokens": "length", "context_overflow": "length",
                  "fatal": "fatal"}
"""Episode stop reason -> the ``finish_reason`` the service answers with (module docstring)."""
FIELDS = frozenset({"model", "messages", "stream", "stream_options", "temperature", "max_tokens",
                    "max_completion_tokens", "seed", "n", "user"})
"""Request fields the service reads; any other is refused (module docstring)."""


@dataclasses.dataclass
class AgentServeConfig:
    """Arguments of ``make_agent_app``."""

    model: str = opt("tiny-agent", "Checkpoint directory, or 'tiny-agent' (the cached tiny agent).")
    name: str = opt("osvl-agent", "The model name clients send (404 for any other).")
    engine: EngineKind = opt("hf", "Token engine.")
    offer: list[str] = opt([], "Tools offered; empty = those the checkpoint was trained with "
                               "(osvl.agent.evaluate.trained_tools), else every tool.")
    tools: Literal["inprocess", "handle"] = opt("inprocess", "Tool transport: handle (the osvl_tools Serve app) or "
                                                             "inprocess.")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings (tools=inprocess): the search engine the checkpoint was trained "
        "with (the GRPO job's rollout.text_search), so that the service's agent reads the hits its policy learnt "
        "on. With tools=handle the tool app's settings apply (serve/app.py): deploy starts it with these unless "
        "it runs already.")
    agent: AgentConfig = opt(AgentConfig(max_turns=6, max_new_tokens=128, max_episode_tokens=3072, temperature=0.0),
                             "Agent budgets of every request.")
    fetch_urls: bool = opt(False, "Fetch http(s) image URLs (through the SSRF guard); off = data URLs only.")
    max_body_bytes: int = opt(16 * 2**20, "Largest request body, bytes (413 above).")
    max_pixels: int = opt(MAX_PIXELS, "Largest image, pixels (413 above).")
    max_images: int = opt(4, "Most images in one request.")
    token_env: str = opt("OSVL_TOOLS_TOKEN", "Environment variable holding the bearer token (the tool API's); "
                                             "when set where the app is built, every /v1 call must carry it.")
    host: str = opt("127.0.0.1", "Address the HTTP proxy binds (python -m serve.agent_app); off loopback the "
                                 "token (token_env) must be set, or the service refuses to start.")
    tool_latency_s: float = opt(0.0, "Simulated extra latency per tool call, seconds (tests, benchmarks).")
    app_name: str = opt(AGENT_APP, "Serve application name of the agent.")
    route_prefix: str = opt("/", "Route prefix of the agent app on the Serve instance.")
    tools_route_prefix: str = opt("/tools", "tools=handle: route prefix of the tool app deploy starts beside the "
                                            "agent when it is not running yet (with ServeConfig's defaults "
                                            "unless deploy is given others).")


class BadRequest(OsvlError):
    """A request the service refuses, with its HTTP status and OpenAI error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error(status: int, code: str, message: str) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"type": kind, "code": code, "message": message}}, status_code=status,
                        headers=headers)


async def _image(url: Any, cfg: AgentServeConfig) -> Any:
    """An ``image_url`` part's URL -> RGB array (``BadRequest`` otherwise)."""
    if not isinstance(url, str) or not url:
        raise BadRequest(400, "bad_image_url", "image_url.url must be a non-empty string")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise BadRequest(400, "bad_image_url", "a data URL must be base64 (data:image/png;base64,...)")
        b64 = data
    elif url.startswith(("http://", "https://")):
        if not cfg.fetch_urls:
            raise BadRequest(400, "url_fetch_disabled", "image URLs are not fetched by this service (fetch_urls "
                                                        "is off); send the image as a base64 data URL")

        try:
            _, _, body = await fetch_url(url, WebConfig())
        except FetchRefused as e:
            raise BadRequest(400, "url_refused", f"image URL refused: {e}") from None
        except Exception as e:  # noqa: BLE001 - any network failure is the client's URL's problem here
            raise BadRequest(400, "url_unreachable", f"image URL could not be fetched: {type(e).__name__}") from None
        b64 = base64.b64encode(body).decode("ascii")
    else:
        raise BadRequest(400, "bad_image_url", "image_url.url must be a data: or http(s): URL")
    try:
        return decode_image(b64, cfg.max_pixels, "image_url")
    except InvalidCall as e:
        raise BadRequest(413 if e.limit else 400, "image_too_large" if e.limit else "unreadable_image",
                         str(e)) from None
    except (binascii.Error, ValueError) as e:
        raise BadRequest(400, "unreadable_image", str(e)) from None


@dataclasses.dataclass
class ChatRequest:
    """What the service takes from one chat-completions body."""

    question: str
    images: list[Any]
    stream: bool
    agent: AgentConfig  # the config's, with the request's temperature and max_tokens
    system: str | None = None
    seed: int = 0


def _number(body: dict[str, Any], key: str, low: float, high: float, integer: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(400, "invalid_field", f"{key} must be {kind} in [{low:g}, {high:g}], got {value!r}")
    return value


async def parse_request(raw: bytes, cfg: AgentServeConfig) -> ChatRequest:
    """The ``ChatRequest`` of a chat-completions body, or ``BadRequest``."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(400, "invalid_json", f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "invalid_body", "body must be a JSON object")
    if body.get("model") != cfg.name:
        raise BadRequest(404, "model_not_found", f"unknown model {body.get('model')!r}; this service serves "
                                                 f"{cfg.name!r}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(400, "unsupported_field", f"unsupported request field(s) {unknown}; this service reads "
                                                   f"{sorted(FIELDS)}")
    _number(body, "n", 1, 1, integer=True)  # one answer per request
    temperature = _number(body, "temperature", 0.0, 2.0)
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 20, integer=True)
    max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", 1, 1 << 20, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "invalid_field", f"stream must be true or false, got {stream!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest(400, "invalid_messages", "messages must be a non-empty list of objects")
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise BadRequest(400, "no_user_message", "no message with role 'user'")
    roles = [m.get("role") for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise BadRequest(400, "unsupported_conversation", "one user message per request, optionally after one system "
                         f"message: the agent answers one question and keeps no conversation (got roles {roles})")
    system = messages[0].get("content") if roles[0] == "system" else None
    if system is not None and not isinstance(system, str):
        raise BadRequest(400, "invalid_content", "a system message's content must be a string")
    seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)
    content = users[-1].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise BadRequest(400, "invalid_content", "content must be a string or a list of content parts")
    texts, urls = [], []
    for p in parts:
        if p.get("type") == "text" and isinstance(p.get("text"), str):
            texts.append(p["text"])
        elif p.get("type") == "image_url" and isinstance(p.get("image_url"), dict):
            urls.append(p["image_url"].get("url"))
        else:
            raise BadRequest(400, "invalid_content", f"unsupported content part {str(p)[:100]}")
    question = "\n".join(line for t in texts for line in t.splitlines() if not _NAME_ONLY.match(line)).strip()
    if not question:
        raise BadRequest(400, "no_question", "the user message has no question text")
    if not urls:
        raise BadRequest(400, "no_image", "the user message has no image_url part: the agent answers questions "
                                          "about an image")
    if len(urls) > cfg.max_images:
        raise BadRequest(413, "too_many_images", f"{len(urls)} images; at most {cfg.max_images}")
    agent = dataclasses.replace(cfg.agent)
    if temperature is not None:
        agent.temperature = float(temperature)
    if max_tokens is not None:
        agent.max_new_tokens = min(agent.max_new_tokens, int(max_tokens))
    return ChatRequest(question, [await _image(u, cfg) for u in urls], stream, agent, system,
                       int(seed or 0) % (1 << 31))  # the loop's generators take 63-bit seeds of seed * 100,003 + turn


def turn_field(t: Any) -> dict[str, Any]:
    return {"index": t.index, "text": t.text, "action": t.action, "tool": t.tool, "arguments": t.arguments,
            "status": t.status, "error_kind": t.error_kind, "observation": t.observation}


def trajectory_field(traj: Any, turns: bool = True) -> dict[str, Any]:
    out = {"stop_reason": traj.stop_reason, "fatal": traj.fatal_kth >= 0, "events": list(traj.events)}
    if turns:
        out["turns"] = [turn_field(t) for t in traj.turns]
    return out


def usage(traj: Any) -> dict[str, int]:
    prompt = sum(1 for m in traj.gen_mask if not m)
    completion = len(traj.gen_mask) - prompt
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


api = FastAPI(title="osvl agent", version="1", description="The osvl agent behind an OpenAI-compatible chat API.")


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
@serve.ingress(api)
class AgentService:
    def __init__(self, cfg: dict[str, Any], model_path: str, token_sha256: str = "") -> None:
        self.cfg = from_dict(AgentServeConfig, cfg)
        self.token_sha256 = token_sha256
        self.tools = offered_tools(self.cfg.offer or trained_tools(model_path))
        if self.cfg.model == "tiny-agent" and not self.cfg.offer:
            self.tools = [t.schema for t in agent_tools().values()]  # the short schemas it was fine-tuned with
        env = build_env(model=model_path, engine=self.cfg.engine, transport=self.cfg.tools,
                        text_search=self.cfg.text_search, latency_s=self.cfg.tool_latency_s)
        self.engine, self.client = env.engine, env.client
        self.served = 0
        self.cancelled = 0  # episodes whose streaming client went away

    _authorized = ToolAPI.func_or_class._authorized  # the tool API's bearer check, not a copy

    async def _read(self, request: Request) -> bytes:
        limit, chunks, size = self.cfg.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > SWALLOW_FACTOR * limit:  # the tool API's reason: let simple clients see the 413
                break
        if size > limit:
            raise BadRequest(413, "body_too_large", f"body of {size}+ bytes exceeds the limit of {limit}")
        return b"".join(chunks)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        """Liveness, and what is running: ``engine_running`` = turns the engine is generating now."""
        stats = getattr(self.engine, "stats", {})
        return {"status": "ok", "model": self.cfg.name, "served": self.served, "cancelled": self.cancelled,
                "engine_running": stats.get("running", 0), "engine_aborted": stats.get("aborted", 0)}

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            return error(401, "invalid_token", "missing or wrong bearer token")
        return JSONResponse({"object": "list", "data": [{"id": self.cfg.name, "object": "model",
                                                         "owned_by": "osvl"}]})

    def _episode(self, req: ChatRequest, qid: str, on_turn: Any = None) -> Any:
        return run_episode(self.engine, {"id": qid, "question": req.question}, req.images, self.client, req.agent,
                           processor=self.engine.processor, tools=self.tools, seed=req.seed, system=req.system,
                           on_turn=on_turn)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        if not self._authorized(request):
            return error(401, "invalid_token", "missing or wrong bearer token")
        try:
            req = await parse_request(await self._read(request), self.cfg)
        except BadRequest as e:
            return error(e.status, e.code, str(e))
        qid = uuid.uuid4().hex[:12]
        if req.stream:
            return StreamingResponse(self._stream(req, qid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            traj = await self._episode(req, qid)
        except OsvlError as e:  # e.g. an image too large for the context even when downscaled
            return error(400, "episode_failed", f"{type(e).__name__}: {e}")
        self.served += 1
        return JSONResponse({
            "id": f"chatcmpl-{qid}", "object": "chat.completion", "created": int(time.time()), "model": self.cfg.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": traj.final_answer or ""},
                         "finish_reason": FINISH_REASONS[traj.stop_reason]}],
            "usage": usage(traj), "osvl_trajectory": trajectory_field(traj)})

    async def _stream(self, req: ChatRequest, qid: str) -> Any:
        """The episode as Server-Sent Events (module docstring); cancelled with the client's connection."""
        head = {"id": f"chatcmpl-{qid}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.cfg.name}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

        turns: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._episode(req, qid, on_turn=turns.put_nowait))
        task.add_done_callback(lambda _: turns.put_nowait(None))
        try:
            yield chunk({"role": "assistant", "content": ""})
            while (turn := await turns.get()) is not None:
                yield chunk({}, osvl_event=turn_field(turn))
            try:
                traj = task.result()
            except OsvlError as e:
                yield sse({"error": {"type": "invalid_request_error", "code": "episode_failed",
                                     "message": f"{type(e).__name__}: {e}"}})
                return
            self.served += 1
            for piece in re.findall(r"\S+\s*|\s+", traj.final_answer or ""):
                yield chunk({"content": piece})
            yield chunk({}, FINISH_REASONS[traj.stop_reason], usage=usage(traj),
                        osvl_trajectory=trajectory_field(traj, turns=False))
            yield sse("[DONE]")
        finally:
            if not task.done():  # the client went away: stop the episode, and with it its engine request
                task.cancel()
                self.cancelled += 1


def make_agent_app(cfg: AgentServeConfig) -> serve.Application:
    """The application for ``cfg``; the checkpoint is resolved (and the tiny agent built) here, in the driver."""
    token = os.environ.get(cfg.token_env, "")
    check_host(cfg)
    digest = hashlib.sha256(token.encode()).hexdigest() if token else ""
    return AgentService.bind(dataclasses.asdict(cfg), resolve_model(cfg.model), digest)


def deploy(cfg: AgentServeConfig, tools: Any = None) -> None:
    """Run the agent app on the running Serve instance; with ``tools: handle`` first the tool app (``tools``, a
    ``serve.app.ServeConfig``; default: every tool, searching with ``cfg.text_search``) at ``tools_route_prefix``,
    unless it already runs."""
    if cfg.tools == "handle":
        run_unless_running(tools or ServeConfig(text_search=cfg.text_search), cfg.tools_route_prefix)
    serve.run(make_agent_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix)


def main(argv: list[str] | None = None) -> None:
    """``python -m serve.agent_app [--port=N] [--<AgentServeConfig field>=value ...]``: serve until Ctrl-C."""
    port, cfg = service_flags(list(sys.argv[1:] if argv is None else argv), AgentServeConfig(), "serve.agent_app")
    check_host(cfg)
    init_ray()
    port = start_serve(port or None, host=cfg.host)
    deploy(cfg)
    base = f"http://{cfg.host}:{port}"
    tools = f"; tool API at {base}{cfg.tools_route_prefix.rstrip('/')}/v1/tools" if cfg.tools == "handle" else ""
    logging.getLogger("serve.agent_app").info(f"osvl agent on {base}{cfg.route_prefix.rstrip('/')}/v1 (model "
                                              f"{cfg.name!r}){tools}")
    serve_until_interrupted()


if __name__ == "__main__":
    from osvl.config import cli

    cli(main)
