"""Web backend of ``text_search``: a Serper-style search API, guarded page fetch, LLM summary.

Flow of one ``WebSearch.search(query, top_k)``: POST the query to the search API
(Serper's JSON: ``{"organic": [{"title", "link", "snippet"}, ...]}``), fetch the first
``fetch_pages`` result pages through the SSRF guard, turn their HTML into text, and ask
an OpenAI-compatible ``/chat/completions`` endpoint to summarise each page *for this
query*. A page that cannot be fetched keeps its search snippet; the hit says why.
API keys come from environment variables named in the config, never from the config.

Trust: the search API and the LLM endpoint are chosen by the operator (config), so they
are called directly (a local vLLM on loopback is a legitimate summariser). Page URLs
come from search results, i.e. from the open web, and are what an attacker controls:
every page fetch, and every redirect hop of it, goes through ``Guard``.

The SSRF guard refuses, by default, every address that is not globally routable:
loopback, RFC 1918 private, link-local (which includes the cloud metadata address
169.254.169.254), CGNAT, multicast, reserved, unspecified, IPv6 ULA and IPv4-mapped forms
of all of these. Host names are checked *inside the connector's resolver*, on the very
addresses the socket then connects to, so a DNS answer cannot change between check and
connect (DNS rebinding); IP literals, which aiohttp does not resolve, are checked before
each request. Redirects are followed by hand, one hop at a time, each hop re-checked.
Bodies are read in chunks and cut at ``max_bytes``; the whole fetch has one deadline.
``allow`` lists exceptions (``IP``, ``IP:port`` or a CIDR) so tests can reach one
loopback server that replays recorded responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html.parser
import ipaddress
import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from osvl.config import opt
from osvl.endpoint import ChatClient, EndpointConfig
from osvl.errors import ConfigError, EndpointUnavailable, FetchRefused, ToolCallError
from osvl.tools.base import TextHit

REDIRECTS = (301, 302, 303, 307, 308)


@dataclasses.dataclass
class WebConfig:
    search_url: str = opt("https://google.serper.dev/search", "Serper-style search endpoint (POST JSON {q, num}).")
    search_key_env: str = opt("SERPER_API_KEY", "Environment variable holding the search API key (X-API-KEY).")
    summary: EndpointConfig = opt(
        EndpointConfig(base_url="https://api.openai.com/v1", model="gpt-4o-mini", api_key_env="OPENAI_API_KEY",
                       timeout_s=10.0, retries=1),
        "The OpenAI-compatible chat model that summarises each fetched page; empty base_url = no summary, the "
        "page's first words instead.")
    fetch_pages: int = opt(3, "Result pages fetched and summarised per query.")
    page_chars: int = opt(6000, "Characters of page text sent to the summariser.")
    summary_tokens: int = opt(200, "max_tokens of one summary.")
    timeout_s: float = opt(10.0, "Deadline of one page fetch (all redirects) and of the search API call.")
    max_bytes: int = opt(2_000_000, "Largest page body read; bigger pages are refused.")
    max_redirects: int = opt(5, "Redirect hops followed per fetch, each re-checked by the guard.")
    allow: list[str] = opt([], "SSRF guard exceptions: IP, IP:port or CIDR that may be fetched although "
                               "not public (tests: the loopback replay server).")


class Guard:
    """Decides whether a (host address, port) may be contacted; see the module doc."""

    def __init__(self, allow: list[str] | tuple[str, ...] = ()) -> None:
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.endpoints: set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = set()
        for entry in allow:
            entry = entry.strip()
            host, sep, port = entry.rpartition(":")
            try:
                if sep and port.isdigit() and host and not host.endswith(":"):
                    self.endpoints.add((ipaddress.ip_address(host.strip("[]")), int(port)))
                else:
                    self.nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ConfigError(f"web.allow entry {entry!r} is not an IP, IP:port or CIDR "
                                  "(host names are not allowed: they can resolve anywhere)") from None

    def check_ip(self, address: str, port: int, host: str = "") -> None:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if (ip, port) in self.endpoints or any(ip in n for n in self.nets):
            return
        inner = ip
        if ip.version == 6:  # an IPv4 address wrapped in IPv6 is judged as that IPv4 address
            inner = ip.ipv4_mapped or ip.sixtofour or ip
        if not inner.is_global or inner.is_multicast:
            what = ("the cloud metadata" if str(inner) in ("169.254.169.254", "fd00:ec2::254")
                    else "a loopback" if inner.is_loopback
                    else "a link-local" if inner.is_link_local
                    else "a private" if inner.is_private else "a non-public")
            via = f" ({host} resolves to {ip})" if host and host != str(ip) else ""
            raise FetchRefused(f"refusing to fetch {host or ip}:{port}{via}: {what} address")

    def check_url(self, url: str) -> tuple[str, int]:
        """Scheme and IP-literal check of one URL; returns (host, port). Names are checked at resolve time."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise FetchRefused(f"refusing to fetch {url!r}: only http and https URLs are fetched")
        if not parts.hostname:
            raise FetchRefused(f"refusing to fetch {url!r}: no host")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise FetchRefused(f"refusing to fetch {url!r}: bad port") from None
        host = parts.hostname
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return host, port  # a name: the resolver checks every address it returns
        self.check_ip(host, port)
        return host, port


def _guarded_resolver(guard: Guard) -> Any:
    # lazy: (d) osvl.tools.client imports without aiohttp (a test checks)
    from aiohttp.abc import AbstractResolver  # noqa: PLC0415
    from aiohttp.resolver import ThreadedResolver  # noqa: PLC0415

    class GuardedResolver(AbstractResolver):
        """Resolve, then refuse the whole name if any of its addresses is refused."""

        def __init__(self) -> None:
            self.inner = ThreadedResolver()

        async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
            infos = await self.inner.resolve(host, port, family)
            for info in infos:
                guard.check_ip(info["host"], port, host)
            return infos

        async def close(self) -> None:
            await self.inner.close()

    return GuardedResolver()


async def fetch(session: Any, url: str, guard: Guard, cfg: WebConfig) -> tuple[str, str, bytes]:
    """GET ``url`` through ``guard`` with redirects followed by hand; returns (final url, content type, body)."""
    import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

    for _ in range(cfg.max_redirects + 1):
        guard.check_url(url)
        try:
            async with session.get(url, allow_redirects=False) as r:
                if r.status in REDIRECTS and "Location" in r.headers:
                    url = str(r.url.join(URL(r.headers["Location"])))
                    continue
                if r.status >= 400:
                    raise ToolCallError("tool_error", f"fetching {url}: HTTP {r.status}")
                if (r.content_length or 0) > cfg.max_bytes:
                    raise ToolCallError("tool_error", f"fetching {url}: {r.content_length} bytes exceeds the "
                                                      f"limit of {cfg.max_bytes}")
                body = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > cfg.max_bytes:
                        raise ToolCallError("tool_error", f"fetching {url}: body exceeds the limit of "
                                                          f"{cfg.max_bytes} bytes")
                return str(r.url), r.headers.get("Content-Type", ""), bytes(body)
        except TimeoutError:
            raise ToolCallError("timeout", f"fetching {url}: no answer within {cfg.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            if isinstance(e.__cause__, FetchRefused):
                raise e.__cause__ from None
            raise ToolCallError("unavailable", f"fetching {url}: {type(e).__name__}: {e}") from None
    raise ToolCallError("tool_error", f"fetching {url}: more than {cfg.max_redirects} redirects")


def guarded_session(guard: Guard, cfg: WebConfig) -> Any:
    """An aiohttp session whose every connection goes through ``guard`` (no proxies, no DNS cache)."""
    import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

    connector = aiohttp.TCPConnector(resolver=_guarded_resolver(guard), use_dns_cache=False, limit=8)
    return aiohttp.ClientSession(connector=connector, trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                 headers={"User-Agent": "osvl-text-search/1"})


async def fetch_url(url: str, cfg: WebConfig) -> tuple[str, str, bytes]:
    """One guarded fetch with its own session and an overall deadline (``timeout_s``)."""
    guard = Guard(cfg.allow)
    async with guarded_session(guard, cfg) as session:
        try:
            return await asyncio.wait_for(fetch(session, url, guard, cfg), cfg.timeout_s)
        except TimeoutError:
            raise ToolCallError("timeout", f"fetching {url}: no answer within {cfg.timeout_s:g} s") from None


class _Text(html.parser.HTMLParser):
    """Visible text of an HTML page: no scripts, styles or head; block tags become line breaks."""

    SKIP = {"script", "style", "noscript", "head", "template", "svg"}
    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "tr", "section", "article", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self.SKIP:
            self._skip += 1
        if tag == "title":
            self._in_title = True
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self._skip:
            self._skip -= 1
        if tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skip:
            self.parts.append(data)


def html_text(body: bytes, content_type: str = "") -> tuple[str, str]:
    """(title, text) of a page; plain-text pages pass through."""
    charset = "utf-8"
    if "charset=" in content_type:
        charset = content_type.split("charset=", 1)[1].split(";")[0].strip() or charset
    try:
        raw = body.decode(charset, "replace")
    except LookupError:
        raw = body.decode("utf-8", "replace")
    if "html" not in content_type and not raw.lstrip()[:1] == "<":
        return "", " ".join(raw.split())
    p = _Text()
    p.feed(raw)
    lines = (" ".join(line.split()) for line in "".join(p.parts).splitlines())
    return " ".join(p.title.split()), "\n".join(line for line in lines if line)


def _run(coro: Any) -> Any:
    """Run a coroutine from sync code, also when the calling thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class WebSearch:
    """The web backend: ``search(query, top_k) -> list[TextHit]`` (sync) and ``asearch`` (async)."""

    def __init__(self, cfg: WebConfig | None = None) -> None:
        self.cfg = cfg or WebConfig()
        summary = self.cfg.summary
        self.backend_id = f"web:{self.cfg.search_url}|{summary.model if summary.base_url else 'nosummary'}"

    def search(self, query: str, top_k: int = 5) -> list:
        return _run(self.asearch(query, top_k))

    async def asearch(self, query: str, top_k: int = 5) -> list:
        import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        llm = ChatClient(cfg.summary, "web.summary") if cfg.summary.base_url else None
        try:
            async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as api:
                results = await self._search_api(api, query, top_k)
                guard = Guard(cfg.allow)
                async with guarded_session(guard, cfg) as pages:
                    todo = results[:cfg.fetch_pages]
                    summaries = await asyncio.gather(*(self._page_summary(llm, pages, guard, query, r) for r in todo))
        finally:
            if llm is not None:
                await llm.close()
        hits = []
        for i, r in enumerate(results):
            summary = summaries[i] if i < len(summaries) else ""
            hits.append(TextHit(title=r.get("title", ""), snippet=r.get("snippet", ""), score=float(-i),
                                url=r.get("link", ""), summary=summary))
        return hits

    async def _search_api(self, api: Any, query: str, top_k: int) -> list[dict[str, Any]]:
        key = os.environ.get(self.cfg.search_key_env, "")
        if not key:
            raise ToolCallError("unavailable", f"web search needs an API key in ${self.cfg.search_key_env}")
        data = await self._post(api, self.cfg.search_url, {"q": query, "num": top_k}, {"X-API-KEY": key})
        organic = data.get("organic") if isinstance(data, dict) else None
        if not isinstance(organic, list):
            raise ToolCallError("tool_error", "search API answer has no 'organic' result list")
        return [r for r in organic if isinstance(r, dict) and r.get("link")][:top_k]

    async def _page_summary(self, llm: ChatClient | None, pages: Any, guard: Guard, query: str,
                            result: dict[str, Any]) -> str:
        """The summary line of one result; a page that fails says why instead of failing the search."""
        url = result["link"]
        try:
            _, ctype, body = await asyncio.wait_for(fetch(pages, url, guard, self.cfg), self.cfg.timeout_s)
        except TimeoutError:
            return f"(page not fetched: no answer within {self.cfg.timeout_s:g} s)"
        except ToolCallError as e:
            return f"(page not fetched: {e.message})"
        title, text = html_text(body, ctype)
        text = text[:self.cfg.page_chars]
        if not text:
            return "(page has no text)"
        if llm is None:
            return " ".join(text.split())[:300]
        return await self._summarise(llm, query, title or result.get("title", ""), text)

    async def _summarise(self, llm: ChatClient, query: str, title: str, text: str) -> str:
        """One page's summary; a summariser that refuses (key, HTTP 4xx) or stays away fails the search."""
        messages = [
            {"role": "system", "content": "Summarise the web page in at most three sentences, keeping only "
                                          "facts relevant to the search query. Say so if it has none."},
            {"role": "user", "content": f"Search query: {query}\n\nPage title: {title}\n\nPage text:\n{text}"},
        ]
        try:
            reply = await llm.complete(messages, 0.0, self.cfg.summary_tokens)
        except (ConfigError, EndpointUnavailable) as e:
            raise ToolCallError("unavailable", f"summary endpoint: {e}") from None
        return " ".join(reply.split())

    async def _post(self, api: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> Any:
        import aiohttp  # noqa: PLC0415 (d) osvl.tools.client imports without aiohttp (a test checks)

        try:
            async with api.post(url, json=payload, headers=headers) as r:
                if r.status >= 400:
                    kind = "unavailable" if r.status in (401, 403, 429) or r.status >= 500 else "tool_error"
                    raise ToolCallError(kind, f"{url}: HTTP {r.status}")
                return await r.json(content_type=None)
        except TimeoutError:
            raise ToolCallError("timeout", f"{url}: no answer within {self.cfg.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise ToolCallError("unavailable", f"{url}: {type(e).__name__}: {e}") from None
        except ValueError as e:
            raise ToolCallError("tool_error", f"{url}: answer is not JSON: {e}") from None
