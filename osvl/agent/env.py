"""The agent's environment, built in one place: engine, tool client, search backends, judges.

Every caller that runs the agent (the rollout actors and their held-out evaluation, the eval
job, the agent service, ``jobs/ask.py``, the trajectories job's teacher, the difficulty filter
and the scripted tiny agent) gets what an episode runs against from ``build_env``. Why one
function: the environment is what a policy is trained in, and a part assembled differently in
one caller is an environment the policy never saw. The search engine was the case in point:
it used to be a module-global default that a caller had to ``configure``, so the agent service
and ``jobs/ask.py``, which never did, searched with other settings than a run that changed them.

Search backends are objects the env owns and hands to the in-process tools as
``ToolContext.options`` (``AgentEnv.search``, keyed by tool name); the tools have no default of
their own. They are ``LazyBackend``\\ s: an index takes seconds (minutes, with ``dense_recall``)
to build or load, and an env whose episodes never search must not pay for it. Two envs in one
process with different settings have two backends (``tests/test_agent_env.py`` checks both that
and, statically, that no other module of osvl, serve or jobs builds engines, tool clients or
search backends).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from osvl.agent.engines import VLLMOptions, make_engine
from osvl.agent.engines.openai import OpenAIChatEngine
from osvl.agent.evaluate import AliasClient, LenientChat
from osvl.agent.judge import LLMJudge
from osvl.agent.reward import ProcessJudge
from osvl.endpoint import EndpointConfig
from osvl.tools.base import LazyBackend, Tool
from osvl.tools.cache import CacheMode
from osvl.tools.client import CachedInProcess, MeteredClient, ToolClient, make_client
from osvl.tools.image_search import ImageSearchConfig, build_image_index
from osvl.tools.outages import OutageConfig, with_outages
from osvl.tools.text_search import TextSearchConfig, build_text_index
from osvl.tools.web import WebSearch


@dataclass
class AgentEnv:
    """What episodes run against. ``engine`` is None where the caller binds one per question (the path
    oracle); ``client`` is None where no tool is offered; ``search`` is the in-process tools' options."""

    engine: Any = None
    client: Any = None
    search: dict[str, Any] = field(default_factory=dict)
    llm_judge: LLMJudge | None = None
    process_judge: ProcessJudge | None = None
    judge_engine: Any = None  # the judges' endpoint client, closed with the env

    async def aclose(self) -> None:
        """Close the tool client and the engines. Endpoint clients reopen on their next request, so an
        env that serves one event loop after another (the trajectories job: one per shard) closes here
        at the end of each loop and is used again in the next."""
        for part in (self.client, self.engine, self.judge_engine):
            close = getattr(part, "close", None)
            if close is not None:
                done = close()  # token engines close synchronously, clients and endpoint engines asynchronously
                if inspect.isawaitable(done):
                    await done


def search_backends(text_search: TextSearchConfig, image_search: ImageSearchConfig) -> dict[str, LazyBackend]:
    """``ToolContext.options`` of the search tools for these settings, each built on its first search.

    ``build_env`` uses it for in-process tools; a process that serves the tools to others (the Serve
    tool app's replicas) uses it with its own config's sections.
    """
    return {"text_search": LazyBackend(_text_backend, text_search),
            "image_search": LazyBackend(lambda cfg: build_image_index(cfg=cfg), image_search)}


def _text_backend(cfg: TextSearchConfig) -> Any:
    """The web backend (search API, page fetch, summary) or the offline BM25 index of the KG."""
    return WebSearch(cfg.web) if cfg.backend == "web" else build_text_index(cfg=cfg)


def build_env(*, model: str = "", engine: str = "hf", max_batch: int = 32, version: int = 0,
              vllm: VLLMOptions | None = None, episode_tokens: int = 0, chat: EndpointConfig | None = None,
              lenient: bool = False, transport: str | None = "inprocess", url: str = "", token: str | None = None,
              tools: Mapping[str, Tool] | None = None, timeout_s: float = 60.0, cache: CacheMode = "off",
              cache_root: str = "", text_search: TextSearchConfig | None = None,
              image_search: ImageSearchConfig | None = None, search: Mapping[str, Any] | None = None,
              latency_s: float = 0.0, recorder: Any = None, aliases: Mapping[str, str] | None = None,
              outages: OutageConfig | None = None, judge: EndpointConfig | None = None,
              judge_cache: str = "") -> AgentEnv:
    """The agent's environment. Every part is optional; what a caller leaves out is None.

    Engine: a token engine over the checkpoint ``model`` (``make_engine(engine, ...)`` with
    ``max_batch``, ``version``, ``vllm``, ``episode_tokens``), or with ``chat`` an OpenAI-compatible
    chat model (``lenient``: plain replies count as the answer, as for API baselines), or neither.

    Tools: ``transport`` ``inprocess`` (``tools``: the tool set, default every registered tool; with
    ``cache`` other than ``off``, every call through the record/replay cache at ``cache_root``),
    ``handle`` (the Serve tool app, which has its own search settings) or ``http`` (``url``, ``token``);
    None offers no tools. In-process search is ``text_search`` / ``image_search`` (default settings when
    None), or the backends ``search`` of another env (a worker that builds an env per task keeps one
    index). Then the wrappers, innermost first: ``latency_s`` / ``recorder`` (simulated latency, tool
    metrics), ``aliases`` (a released checkpoint's tool names), ``outages`` (seeded tool outages).

    Judges: with ``judge``, an LLM answer judge (verdicts cached in ``judge_cache`` when given) and a
    process judge on one endpoint client; without, the rule judge scores.
    """
    env = AgentEnv()
    if chat is not None:
        env.engine = OpenAIChatEngine(chat, cut=transport is not None)  # a reply is cut after its tool call
        if lenient:
            env.engine = LenientChat(env.engine)
    elif model:
        env.engine = make_engine(engine, model, max_batch=max_batch, version=version, vllm=vllm,
                                 episode_tokens=episode_tokens)
    if transport == "inprocess":  # handle and http callers search with the tool app's settings
        env.search = dict(search) if search is not None else search_backends(
            text_search or TextSearchConfig(), image_search or ImageSearchConfig())
    if transport is not None:
        if transport == "inprocess" and cache != "off":
            client: Any = ToolClient(CachedInProcess(cache, cache_root, options=env.search, tools=tools),
                                     timeout_s=timeout_s)
        else:
            client = make_client(transport, url=url, token=token, tools=tools, options=env.search,
                                 timeout_s=timeout_s)
        if latency_s > 0 or recorder is not None:
            client = MeteredClient(client, latency_s, recorder)
        if aliases:
            client = AliasClient(client, aliases)
        env.client = with_outages(client, outages)
    if judge is not None:
        env.judge_engine = OpenAIChatEngine(judge, cut=False)
        env.llm_judge = LLMJudge(env.judge_engine, cache_path=judge_cache or None)
        env.process_judge = ProcessJudge(env.judge_engine)
    return env
