"""osvl's tools as an MCP server (Model Context Protocol, streamable HTTP at ``/mcp``).

Why: MCP clients (desktop assistants, IDE agents, other labs' agent loops) find and call tools by
protocol rather than by reading ``serve/README.md``; this server offers them exactly the tool
API's tools, nothing else. It is a thin adapter: every call goes through an
``osvl.tools.client.ToolClient`` (``transport``: ``inprocess``, the tool API over ``http`` at
``tools_url``, or the ``handle``s of its Serve app inside the cluster), so a tool's behaviour,
validation and typed errors are the ones the agent and the HTTP API see.

Tools: the same names, descriptions and JSON argument schemas as ``osvl.tools.registry``, plus
one optional argument, ``images``: osvl tools name their images (``"image": "img_1"``), so a call
brings the pixels along as ``{"img_1": "<base64 PNG/JPEG/WebP>"}`` (decoded with the tool API's
codec: header checked against ``max_pixels`` before any pixel is). A result becomes a
``CallToolResult``: the text, then one PNG ``ImageContent`` per new image (``img_2``, ...);
``isError`` for every error; and ``structuredContent``
``{"status": "ok"|"error", "error": {"kind", "message"} | null, "images": [new names]}``, so
clients can branch on the HTTP API's typed kinds (``invalid_call``, ``tool_error``, ``timeout``,
``unavailable``) instead of parsing text. An unknown tool or a malformed ``images`` is an
``invalid_call`` result, not a protocol error: the model that made the call should see it.

Security, the tool API's rule: it binds to 127.0.0.1 (``host`` moves it, and off loopback the
token is required: it refuses to start without one); when the variable named by ``token_env``
is set where the app is built, every HTTP request needs ``Authorization: Bearer <token>`` (the
tool API's check, imported) and gets a 401 with a typed JSON body otherwise. The gate is a
plain ASGI wrapper, not the SDK's OAuth resource-server machinery: one shared secret, as for the
tool API. With ``transport: http`` the same token is sent on to the tool API.

    python -m serve.mcp_app --port=8002                        # then an MCP client at http://127.0.0.1:8002/mcp
    python -m serve.mcp_app --tools=crop,ocr --transport=http --tools_url=http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import hashlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Literal

import mcp_types as types
import uvicorn
from mcp.server.lowlevel.server import Server
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from osvl.agent.env import build_env
from osvl.cluster import free_port, init_ray, start_serve
from osvl.config import opt
from osvl.errors import ConfigError, InvalidCall
from osvl.tools.base import MAX_PIXELS, Tool, ToolResult
from osvl.tools.client import ToolClient, decode_image, png_bytes, result_to_wire
from osvl.tools.registry import all_tools
from osvl.tools.text_search import TextSearchConfig
from serve.app import ToolAPI, check_host, run_unless_running, service_flags

MCP_PATH = "/mcp"
IMAGES_PROPERTY: dict[str, Any] = {
    "type": "object",
    "description": "The images this call refers to by name, e.g. {\"img_1\": \"<base64 PNG, JPEG or WebP>\"}. "
                   "New images come back as PNG image content named img_2, img_3, ... (structuredContent.images).",
    "additionalProperties": {"type": "string", "contentEncoding": "base64"},
}
"""The argument every MCP tool has beside the tool's own: its images, by name."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclasses.dataclass
class McpConfig:
    """Arguments of ``build_app``."""

    tools: list[str] = opt([], "Tools offered; empty = every registered tool (osvl.tools.registry.all_tools).")
    transport: Literal["inprocess", "http", "handle"] = opt("inprocess", "How calls reach the tools "
                                                                        "(osvl.agent.env.build_env): in this "
                                                                        "process, the tool API over HTTP "
                                                                        "(tools_url), or its Serve handles.")
    tools_url: str = opt("", "transport=http: the tool API's base URL, e.g. http://127.0.0.1:8000.")
    host: str = opt("127.0.0.1", "Address uvicorn binds (python -m serve.mcp_app); off loopback the token "
                                 "(token_env) must be set, or the server refuses to start.")
    token_env: str = opt("OSVL_TOOLS_TOKEN", "Environment variable holding the bearer token (the tool API's); "
                                             "when set where the app is built, every request must carry it.")
    max_pixels: int = opt(MAX_PIXELS, "Largest image a call may send, pixels (invalid_call above).")
    max_body_bytes: int = opt(32 * 2**20, "Largest request body, bytes (the tool API's default; base64 images "
                                          "are a third larger than their files).")
    timeout_s: float = opt(60.0, "Deadline of one tool call, seconds (a timeout result after).")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings (transport=inprocess); with http or handle the tool API's apply.")


def served_tools(cfg: McpConfig) -> dict[str, Tool]:
    """name -> Tool of the tools ``cfg`` offers, in the registry's order; unknown names are a ``ConfigError``."""
    tools = all_tools()
    unknown = sorted(set(cfg.tools) - set(tools))
    if unknown:
        raise ConfigError(f"mcp.tools: unknown tools {unknown}; registered: {list(tools)}")
    chosen = {n: t for n, t in tools.items() if not cfg.tools or n in cfg.tools}
    clash = [n for n, t in chosen.items() if "images" in t.parameters.get("properties", {})]
    if clash:  # the MCP argument would shadow the tool's own
        raise ConfigError(f"tools {clash} have an argument named 'images', which the MCP server reserves")
    return chosen


def mcp_tool(tool: Tool) -> types.Tool:
    """The MCP description of ``tool``: its schema plus ``images`` (a copy: the registry's stays as it is)."""
    schema = copy.deepcopy(tool.parameters)
    schema.setdefault("type", "object")
    schema["properties"] = {**schema.get("properties", {}), "images": copy.deepcopy(IMAGES_PROPERTY)}
    return types.Tool(name=tool.name, description=tool.description, input_schema=schema)


def decode_images(value: Any, max_pixels: int) -> dict[str, Any]:
    """The ``images`` argument -> name -> RGB array; ``InvalidCall`` unless it is a name -> base64 object."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidCall(f"images must be an object mapping image names to base64 images, "
                          f"got {type(value).__name__}")
    return {name: decode_image(data, max_pixels, name) for name, data in value.items()}


def to_mcp(result: ToolResult) -> types.CallToolResult:
    """``ToolResult`` -> ``CallToolResult`` (module docstring); PNG-encodes the new images."""
    content: list[Any] = [types.TextContent(text=result.text)]
    content += [types.ImageContent(data=base64.b64encode(png_bytes(arr)).decode("ascii"), mime_type="image/png")
                for arr in result.images.values()]
    error = None if result.error is None else {"kind": result.error.kind, "message": result.error.message}
    return types.CallToolResult(content=content, is_error=not result.ok,
                                structured_content={"status": result.status, "error": error,
                                                    "images": list(result.images)})


def make_server(cfg: McpConfig, tools: dict[str, Tool], client: ToolClient) -> Server[Any]:
    """The MCP server offering ``tools`` through ``client`` (closed when the server's lifespan ends)."""
    listing = [mcp_tool(t) for t in tools.values()]
    schemas = {t.name: t.input_schema for t in listing}

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listing)  # seven tools at most: one page, no cursor

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = dict(params.arguments or {})
        if params.name not in tools:
            return to_mcp(ToolResult.fail("invalid_call", f"unknown tool {params.name!r}; known: {list(tools)}"))
        try:  # base64 and PNG decoding are CPU work: off the event loop, as the HTTP client does it
            images = await asyncio.to_thread(decode_images, arguments.pop("images", None), cfg.max_pixels)
        except InvalidCall as e:
            return to_mcp(ToolResult.fail("invalid_call", f"{params.name}: {e}", limit=e.limit))
        result = await client.call(params.name, arguments, images)
        return await asyncio.to_thread(to_mcp, result)

    @contextlib.asynccontextmanager
    async def lifespan(_: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:  # the http transport holds an aiohttp session on the server's event loop
            await client.close()

    return Server("osvl-tools", version="1", instructions="osvl's vision and search tools. Tools name their "
                  "images: send them under `images` ({\"img_1\": base64 PNG}) and refer to them as img_1.",
                  lifespan=lifespan, get_tool_input_schema=schemas.get, on_list_tools=list_tools,
                  on_call_tool=call_tool)


class BearerGate:
    """ASGI wrapper: every HTTP request needs the bearer token whose sha256 is ``token_sha256`` (none: open).

    The check is the tool API's own (``ToolAPI._authorized``, digests compared in constant time),
    so the two services cannot drift apart; lifespan events pass, they carry no request.
    """

    _authorized = ToolAPI.func_or_class._authorized

    def __init__(self, app: AsgiApp, token_sha256: str) -> None:
        self.app, self.token_sha256 = app, token_sha256

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or self._authorized(HTTPConnection(scope)):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = result_to_wire(ToolResult.fail("invalid_call", "missing or wrong bearer token"))
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        else:  # a websocket: refused before it is accepted
            await send({"type": "websocket.close", "code": 1008})


def build_app(cfg: McpConfig) -> AsgiApp:
    """The ASGI app for ``cfg`` (serve it with uvicorn); the token is read here, as the tool API reads it."""
    check_host(cfg)
    tools = served_tools(cfg)
    token = os.environ.get(cfg.token_env, "")
    if cfg.transport == "http" and not cfg.tools_url:
        raise ConfigError("transport=http needs tools_url, the tool API's base URL (http://127.0.0.1:8000)")
    client = build_env(transport=cfg.transport, url=cfg.tools_url, token=token or None, tools=tools,
                       timeout_s=cfg.timeout_s, text_search=cfg.text_search).client
    # host decides the SDK's DNS-rebinding guard (on for loopback: a web page cannot reach a local server)
    app = make_server(cfg, tools, client).streamable_http_app(streamable_http_path=MCP_PATH, host=cfg.host,
                                                              max_request_body_size=cfg.max_body_bytes)
    return BearerGate(app, hashlib.sha256(token.encode()).hexdigest() if token else "")


def _start_tool_app() -> None:
    """transport=handle: join Ray and run the tool API's Serve app unless it runs already (as serve.agent_app)."""
    init_ray()
    start_serve()  # a Serve instance on loopback (one already running is kept as it is)
    run_unless_running()


async def _serve(server: Any, url: str) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:  # announced once the socket is bound, as the other services do
        logging.getLogger("serve.mcp_app").info(f"osvl MCP tools on {url}")
    await task


def main(argv: list[str] | None = None) -> None:
    """``python -m serve.mcp_app [--port=N] [--<McpConfig field>=value ...]``: serve until Ctrl-C."""
    port, cfg = service_flags(list(sys.argv[1:] if argv is None else argv), McpConfig(), "serve.mcp_app")
    check_host(cfg)
    if cfg.transport == "handle":
        _start_tool_app()
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(cfg), host=cfg.host, port=port, log_level="warning"))
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    asyncio.run(_serve(server, f"http://{host}:{port}{MCP_PATH}"))  # uvicorn turns Ctrl-C into a clean exit


if __name__ == "__main__":
    from osvl.config import cli

    cli(main)
