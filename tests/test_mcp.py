"""osvl's tools as an MCP server: the official SDK client over streamable HTTP against a real uvicorn server.

One server for the module (crop and text_search in-process, a bearer token required): the client lists the
tools with the tool API's schemas plus ``images``, crops a real image and gets the PNG back, searches the
embedded KG sample, gets typed ``invalid_call`` results for bad calls; requests without the token get a 401.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from osvl.errors import ConfigError

pytestmark = pytest.mark.slow

TOKEN_ENV = "OSVL_MCP_TEST_TOKEN"
TOKEN = "s3cret-mcp-token"
TOOLS = ["crop", "text_search"]


@contextlib.contextmanager
def serving(app: Any) -> Any:
    """The URL of ``app`` served by a real uvicorn server on loopback, in a daemon thread; stopped after."""
    import uvicorn

    from osvl.cluster import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP server did not start within 15 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def mcp_url() -> Any:
    """URL of the MCP app with crop and text_search in-process, token required."""
    from serve.mcp_app import McpConfig, build_app

    os.environ[TOKEN_ENV] = TOKEN
    try:
        app = build_app(McpConfig(tools=TOOLS, token_env=TOKEN_ENV))  # the token is read here, once
    finally:
        os.environ.pop(TOKEN_ENV)
    with serving(app) as url:
        yield url


@contextlib.asynccontextmanager
async def client(url: str, token: str | None = TOKEN, mode: str = "auto") -> Any:
    import httpx2
    from mcp.client import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0)) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as c:
            yield c


def run(url: str, work: Any, mode: str = "auto") -> Any:
    async def go() -> Any:
        async with client(url, mode=mode) as c:
            return await work(c)

    return asyncio.run(go())


def test_lists_the_tool_api_schemas_plus_images(mcp_url):
    from osvl.tools.registry import all_tools
    from serve.mcp_app import IMAGES_PROPERTY

    async def work(c):
        return (await c.list_tools()).tools

    tools = run(mcp_url, work)
    assert [t.name for t in tools] == TOOLS
    registry = all_tools()
    for t in tools:
        schema = json.loads(json.dumps(t.input_schema))
        assert schema["properties"].pop("images") == IMAGES_PROPERTY
        assert schema == registry[t.name].parameters
        assert t.description == registry[t.name].description


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # 2026-07-28 per-request, and the initialize handshake
def test_crop_returns_the_cropped_png(mcp_url, mode):
    from PIL import Image

    from osvl.tools.client import encode_image

    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)  # 64 wide, 48 high

    async def work(c):
        return await c.call_tool("crop", {"image": "img_1", "x": 10, "y": 5, "width": 30, "height": 20,
                                          "images": {"img_1": encode_image(img)}})

    result = run(mcp_url, work, mode)
    assert result.is_error is False
    assert result.structured_content == {"status": "ok", "error": None, "images": ["img_2"]}
    text, picture = result.content
    assert text.type == "text" and "img_2" in text.text
    assert picture.type == "image" and picture.mime_type == "image/png"
    with Image.open(io.BytesIO(base64.b64decode(picture.data))) as im:
        assert im.format == "PNG" and im.size == (30, 20)
        np.testing.assert_array_equal(np.asarray(im.convert("RGB")), img[5:25, 10:40])


def test_text_search_answers_from_the_kg_sample(mcp_url):
    async def work(c):
        return await c.call_tool("text_search", {"query": "Eiffel Tower Paris", "top_k": 3})

    result = run(mcp_url, work)
    assert result.is_error is False and result.structured_content["status"] == "ok"
    assert [c.type for c in result.content] == ["text"]
    assert "Eiffel" in result.content[0].text


@pytest.mark.parametrize("name, arguments", [
    ("crop", {"image": "img_1", "x": 0, "y": 0, "width": -4, "height": 4}),  # negative width
    ("crop", {"image": "img_1", "x": 0, "y": 0, "width": 4}),  # a required argument missing
    ("crop", {"image": "img_7", "x": 0, "y": 0, "width": 4, "height": 4}),  # an image that was not sent
    ("crop", {"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4, "images": ["not", "an", "object"]}),
    ("crop", {"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4, "images": {"img_1": "not base64!"}}),
    ("sharpen", {"image": "img_1"}),  # registered, but not offered by this server
    ("no_such_tool", {}),
])
def test_bad_calls_are_typed_invalid_call_results(mcp_url, name, arguments):
    from osvl.tools.client import encode_image

    arguments = {"images": {"img_1": encode_image(np.zeros((8, 8, 3), np.uint8))}, **arguments}

    async def work(c):
        return await c.call_tool(name, arguments)

    result = run(mcp_url, work)
    assert result.is_error is True
    assert result.structured_content["status"] == "error" and result.structured_content["images"] == []
    assert result.structured_content["error"]["kind"] == "invalid_call", result.structured_content
    assert result.content[0].text.startswith("Error (invalid_call): ")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}])
def test_requests_without_the_token_get_401(mcp_url, headers):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}).encode()
    req = urllib.request.Request(mcp_url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    answer = json.loads(e.value.read())
    assert answer["status"] == "error" and answer["error"]["kind"] == "invalid_call"


def test_sdk_client_without_the_token_fails(mcp_url):
    async def go():
        async with client(mcp_url, token=None) as c:
            await c.list_tools()

    from mcp.shared.exceptions import MCPError

    with pytest.raises(ExceptionGroup) as e:  # the SDK answers the 401 as an MCP error, inside its task groups
        asyncio.run(go())
    assert e.group_contains(MCPError, match="error response"), repr(e.value)


def test_an_unreachable_tool_api_is_unavailable():
    """transport=http to a port nothing listens on: the client's typed ``unavailable`` reaches the MCP client."""
    from osvl.cluster import free_port
    from serve.mcp_app import McpConfig, build_app

    app = build_app(McpConfig(tools=["text_search"], transport="http", tools_url=f"http://127.0.0.1:{free_port()}",
                              token_env="OSVL_MCP_TEST_UNSET_TOKEN"))

    async def work(c):
        return await c.call_tool("text_search", {"query": "Eiffel Tower"})

    with serving(app) as url:
        result = run(url, work)
    assert result.is_error is True
    assert result.structured_content["error"]["kind"] == "unavailable", result.structured_content


def test_off_loopback_needs_the_token(monkeypatch):
    from serve.mcp_app import McpConfig, check_host

    unset = "OSVL_MCP_TEST_UNSET_TOKEN"
    monkeypatch.delenv(unset, raising=False)
    with pytest.raises(ConfigError, match="without a bearer token"):
        check_host(McpConfig(host="0.0.0.0", token_env=unset))
    check_host(McpConfig(host="127.0.0.1", token_env=unset))  # loopback stays open without one
    monkeypatch.setenv(unset, "t0ken")
    check_host(McpConfig(host="0.0.0.0", token_env=unset))


def test_unknown_tools_are_refused_at_build():
    from serve.mcp_app import McpConfig, build_app

    with pytest.raises(ConfigError, match="unknown tools"):
        build_app(McpConfig(tools=["crop", "no_such_tool"]))
