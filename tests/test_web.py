"""Web backend: SSRF guard against real loopback servers, and text_search end to end over a replay server.

The replay server is a real aiohttp server on 127.0.0.1 (free port) that answers with
recorded Serper-style search JSON, page HTML and OpenAI-style chat completions; the
backend reaches it only because the test allowlists exactly that host:port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import osvl.tools.text_search  # noqa: F401 - registers text_search
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError, ToolCallError
from osvl.tools.base import REGISTRY, ToolContext, call_tool
from osvl.tools.web import FetchRefused, Guard, WebConfig, WebSearch, fetch_url, html_text

EIFFEL_HTML = """<!doctype html><html><head><title>Eiffel Tower - Facts</title>
<style>body {color: red}</style><script>var tracking = "do not index me";</script></head>
<body><nav>Home | About</nav><h1>Eiffel Tower</h1>
<p>The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.</p>
<p>It is named after the engineer Gustave Eiffel, whose company designed and built the tower
from 1887 to 1889.</p></body></html>"""

GUSTAVE_HTML = """<html><head><title>Gustave Eiffel</title></head><body>
<p>Alexandre Gustave Eiffel (15 December 1832 &ndash; 27 December 1923) was a French civil engineer.</p>
</body></html>"""

RECORDED_SUMMARIES = {
    "Eiffel Tower - Facts": "The Eiffel Tower in Paris was designed and built by Gustave Eiffel's company "
                            "between 1887 and 1889.",
    "Gustave Eiffel": "Gustave Eiffel, the engineer behind the tower, was born on 15 December 1832.",
}


@dataclass
class Replay:
    """Handle of a running loopback server: its base URL and every request it received."""

    base: str
    port: int
    requests: list[tuple[str, str, dict]] = field(default_factory=list)  # (method, path, json body)

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.requests]


def _serve(routes_for) -> Iterator[Replay]:
    """Run an aiohttp app on 127.0.0.1:<free port> in a thread with its own event loop."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def start() -> None:
        app = web.Application()
        replay = Replay("", 0)
        routes_for(app, replay)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        replay.base, replay.port = f"http://127.0.0.1:{port}", port
        box["runner"], box["replay"] = runner, replay
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30), "loopback server did not start"
    try:
        yield box["replay"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def _replay_routes(app, replay: Replay) -> None:
    from aiohttp import web

    async def log(request) -> dict:
        body = await request.json() if request.method == "POST" else {}
        replay.requests.append((request.method, request.path_qs, body))
        return body

    async def search(request):
        body = await log(request)
        if request.headers.get("X-API-KEY") != "test-search-key":
            return web.json_response({"message": "Unauthorized."}, status=403)
        organic = [
            {"title": "Eiffel Tower - Facts", "link": f"{replay.base}/page/eiffel", "position": 1,
             "snippet": "The Eiffel Tower is a wrought-iron lattice tower in Paris."},
            {"title": "Gustave Eiffel biography", "link": f"{replay.base}/page/gustave", "position": 2,
             "snippet": "French civil engineer (1832-1923)."},
            {"title": "Tower metadata", "link": f"{replay.base}/redirect?to=http://169.254.169.254/latest/meta-data/",
             "position": 3, "snippet": "A page that redirects to the cloud metadata service."},
            {"title": "Paris", "link": f"{replay.base}/page/paris", "position": 4, "snippet": "Capital of France."},
        ]
        return web.json_response({"searchParameters": {"q": body["q"], "num": body["num"]},
                                  "organic": organic[:body["num"]]})

    async def page(request):
        await log(request)
        html = {"eiffel": EIFFEL_HTML, "gustave": GUSTAVE_HTML}.get(request.match_info["name"])
        if html is None:
            return web.Response(status=404, text="not found")
        return web.Response(text=html, content_type="text/html")

    async def redirect(request):
        await log(request)
        raise web.HTTPFound(request.query["to"])

    async def loop_(request):
        await log(request)
        raise web.HTTPFound("/loop")

    async def big(request):
        await log(request)
        return web.Response(body=b"x" * 3_000_000, content_type="text/plain")

    async def slow(request):
        await log(request)
        await asyncio.sleep(5)
        return web.Response(text="late")

    async def chat(request):
        body = await log(request)
        if request.headers.get("Authorization") != "Bearer test-llm-key":
            return web.json_response({"error": "bad key"}, status=401)
        user = body["messages"][-1]["content"]
        title = user.split("Page title: ", 1)[1].split("\n", 1)[0]
        content = RECORDED_SUMMARIES.get(title, "The page has nothing relevant.")
        return web.json_response({"id": "chatcmpl-replay", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": content}}]})

    app.router.add_post("/search", search)
    app.router.add_get("/page/{name}", page)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/loop", loop_)
    app.router.add_get("/big", big)
    app.router.add_get("/slow", slow)
    app.router.add_post("/v1/chat/completions", chat)


def _counting_routes(app, replay: Replay) -> None:
    from aiohttp import web

    async def anything(request):
        replay.requests.append((request.method, request.path_qs, {}))
        return web.Response(text="internal secret")

    app.router.add_route("*", "/{tail:.*}", anything)


@pytest.fixture(scope="module")
def replay() -> Iterator[Replay]:
    yield from _serve(_replay_routes)


@pytest.fixture(scope="module")
def internal() -> Iterator[Replay]:
    """A second loopback server standing for an internal service: nothing may ever reach it."""
    yield from _serve(_counting_routes)


def _fetch(url: str, cfg: WebConfig):
    return asyncio.run(fetch_url(url, cfg))


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://127.1.2.3:8080/x", "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data/", "http://[::1]/", "http://[fe80::1]/", "http://[fd00:ec2::254]/",
    "http://[::ffff:10.0.0.1]/", "http://[::ffff:169.254.169.254]/", "http://0.0.0.0/", "http://100.64.0.1/",
    "http://224.0.0.1/", "file:///etc/passwd", "ftp://93.184.216.34/", "gopher://93.184.216.34/", "http:///nohost",
])
def test_guard_refuses_non_public_targets_by_default(url):
    with pytest.raises(FetchRefused):
        Guard().check_url(url)


def test_guard_passes_public_literals_and_names_to_the_resolver():
    assert Guard().check_url("https://93.184.216.34/page") == ("93.184.216.34", 443)
    assert Guard().check_url("http://example.org:8080/") == ("example.org", 8080)  # names: checked at resolve
    # an allowlisted endpoint is exactly that ip:port; a CIDR entry opens a whole network
    g = Guard(["127.0.0.1:8123", "10.1.0.0/16"])
    assert g.check_url("http://127.0.0.1:8123/")[1] == 8123
    g.check_url("http://10.1.2.3:99/")
    for url in ("http://127.0.0.1:8124/", "http://10.2.0.1/", "http://[::1]:8123/"):
        with pytest.raises(FetchRefused):
            g.check_url(url)
    assert Guard(["[::1]:8123", "fd00::/8"]).check_url("http://[::1]:8123/")[1] == 8123
    with pytest.raises(ConfigError, match="not an IP"):
        Guard(["localhost:8123"])


def test_default_guard_refuses_a_live_loopback_server_and_localhost(internal):
    cfg = WebConfig(timeout_s=5)
    before = len(internal.requests)
    for url in (f"{internal.base}/", f"http://localhost:{internal.port}/", f"http://[::1]:{internal.port}/"):
        with pytest.raises(FetchRefused, match="loopback"):
            _fetch(url, cfg)
    assert len(internal.requests) == before, "a refused fetch reached the server"


def test_allowlisted_server_is_fetched_and_its_redirects_are_rechecked(replay, internal):
    cfg = WebConfig(allow=[f"127.0.0.1:{replay.port}"], timeout_s=5)
    final, ctype, body = _fetch(f"{replay.base}/page/eiffel", cfg)
    assert final.endswith("/page/eiffel") and "text/html" in ctype and b"lattice tower" in body
    # a redirect hop to another loopback port (an internal service), to a name resolving to loopback,
    # and to the metadata address are all refused, and nothing reaches the internal server
    before = len(internal.requests)
    for target, why in ((f"{internal.base}/admin", "loopback"), (f"http://localhost:{internal.port}/", "loopback"),
                        ("http://169.254.169.254/latest/meta-data/", "metadata"), ("http://10.0.0.7/", "private")):
        with pytest.raises(FetchRefused, match=why):
            _fetch(f"{replay.base}/redirect?to={target}", cfg)
    assert len(internal.requests) == before
    # a relative redirect back to the allowlisted server is followed
    final, _, body = _fetch(f"{replay.base}/redirect?to=/page/gustave", cfg)
    assert final.endswith("/page/gustave") and b"civil engineer" in body


def test_fetch_limits_size_time_and_redirects(replay):
    cfg = WebConfig(allow=[f"127.0.0.1:{replay.port}"], timeout_s=1.0, max_bytes=1_000_000, max_redirects=3)
    with pytest.raises(ToolCallError, match="exceeds the limit") as e:
        _fetch(f"{replay.base}/big", cfg)
    assert e.value.kind == "tool_error"
    with pytest.raises(ToolCallError) as e:
        _fetch(f"{replay.base}/slow", cfg)
    assert e.value.kind == "timeout"
    with pytest.raises(ToolCallError, match="more than 3 redirects"):
        _fetch(f"{replay.base}/loop", cfg)


def test_html_text_keeps_visible_text_only():
    title, text = html_text(EIFFEL_HTML.encode(), "text/html; charset=utf-8")
    assert title == "Eiffel Tower - Facts"
    assert "wrought-iron lattice tower" in text and "Gustave Eiffel" in text
    assert "tracking" not in text and "color: red" not in text
    assert html_text(GUSTAVE_HTML.encode(), "text/html")[1].startswith("Alexandre Gustave Eiffel (15 December 1832 –")


def _web_cfg(replay: Replay, summary_url: str | None = None, **kw) -> WebConfig:
    summary = EndpointConfig(base_url=f"{replay.base}/v1" if summary_url is None else summary_url,
                             model="replay-model", api_key_env="OPENAI_API_KEY", timeout_s=5.0, retries=0)
    base = {"search_url": f"{replay.base}/search", "summary": summary, "allow": [f"127.0.0.1:{replay.port}"],
            "timeout_s": 5.0}
    return WebConfig(**{**base, **kw})


def test_text_search_web_backend_end_to_end(replay, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "test-search-key")
    monkeypatch.setenv("OPENAI_API_KEY", "test-llm-key")
    start = len(replay.requests)
    backend = WebSearch(_web_cfg(replay))
    ctx = ToolContext(images={}, options={"text_search": backend})
    res = call_tool(REGISTRY["text_search"], {"query": "who built the Eiffel Tower", "top_k": 3}, ctx)
    assert res.ok, res.text
    lines = res.text.splitlines()
    assert lines[0] == 'Search results for "who built the Eiffel Tower":'
    assert lines[1] == f"1. Eiffel Tower - Facts ({replay.base}/page/eiffel)"
    assert lines[2] == "   Summary: " + RECORDED_SUMMARIES["Eiffel Tower - Facts"]
    assert lines[4] == "   Summary: " + RECORDED_SUMMARIES["Gustave Eiffel"]
    assert lines[5].startswith("3. Tower metadata")
    assert "page not fetched: refusing to fetch 169.254.169.254" in lines[6]
    assert [h["url"] for h in res.data["hits"]][:2] == [f"{replay.base}/page/eiffel", f"{replay.base}/page/gustave"]
    reqs = replay.requests[start:]
    search = [b for m, p, b in reqs if p == "/search"]
    assert search == [{"q": "who built the Eiffel Tower", "num": 3}]
    chats = [b for m, p, b in reqs if p == "/v1/chat/completions"]
    assert len(chats) == 2 and all(c["model"] == "replay-model" for c in chats)
    sent = " ".join(c["messages"][-1]["content"] for c in chats)
    assert "wrought-iron lattice tower" in sent and "tracking" not in sent
    assert "Search query: who built the Eiffel Tower" in sent


def test_web_backend_failures_are_typed(replay, monkeypatch):
    ctx = ToolContext(images={}, options={"text_search": WebSearch(_web_cfg(replay))})
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    res = call_tool(REGISTRY["text_search"], {"query": "x"}, ctx)
    assert res.error.kind == "unavailable" and "SERPER_API_KEY" in res.error.message
    monkeypatch.setenv("SERPER_API_KEY", "wrong")
    res = call_tool(REGISTRY["text_search"], {"query": "x"}, ctx)
    assert res.error.kind == "unavailable" and "HTTP 403" in res.error.message
    # a summariser that rejects the key fails the search (the operator's endpoint is broken, not a page)
    monkeypatch.setenv("SERPER_API_KEY", "test-search-key")
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    res = call_tool(REGISTRY["text_search"], {"query": "x", "top_k": 1}, ctx)
    assert res.error.kind == "unavailable" and "HTTP 401" in res.error.message
    # without a summariser the page's first words stand in
    monkeypatch.delenv("OPENAI_API_KEY")
    plain = WebSearch(_web_cfg(replay, summary_url=""))
    hits = plain.search("eiffel", 1)
    assert "Eiffel Tower The Eiffel Tower is a wrought-iron lattice tower" in hits[0].summary
    assert "\n" not in hits[0].summary and plain.backend_id != WebSearch(_web_cfg(replay)).backend_id


def test_sync_search_works_inside_a_running_event_loop(replay, monkeypatch):
    """Serve deployments call tools from async code: the sync API must not need a free loop."""
    monkeypatch.setenv("SERPER_API_KEY", "test-search-key")
    monkeypatch.setenv("OPENAI_API_KEY", "test-llm-key")
    backend = WebSearch(_web_cfg(replay, fetch_pages=1))

    async def inside():
        return backend.search("eiffel", 2)

    hits = asyncio.run(inside())
    assert hits[0].summary == RECORDED_SUMMARIES["Eiffel Tower - Facts"] and hits[1].summary == ""
