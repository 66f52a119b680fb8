"""``jobs/eval.py``: Pass@1 of one model on benchmark files, in the direct, RAG and agentic modes.

The driver loads every benchmark (``osvl.eval.loaders``), skips the (benchmark, mode, id)
triples already in the run's ``items.jsonl`` (a killed run resumes where it stopped),
and hands the rest, in chunks, to ``workers`` Ray actors. Each actor holds one model
and one tool client and runs a chunk's items concurrently through the per-item core
(``osvl.agent.evaluate.evaluate_item``), so a token engine batches the turns of the
episodes that wait for it while the others wait for tools. Every finished chunk is
appended to ``items.jsonl`` at once; the tables, the summary and the chart are rebuilt
from that file at the end, so they always describe every item scored so far.

Determinism: greedy decoding by default, per-item seeds from the item id, and every tool
call through the record/replay cache (``tool_cache: replay``): the first run records, a
rerun with the same model replays the same tool answers and gives the same scores.

Models (``model``): a checkpoint directory (token engine ``engine``: hf or vllm),
``tiny-agent`` / ``tiny`` (the cached tiny checkpoints), ``openai:NAME`` (an
OpenAI-compatible chat endpoint, the ``endpoint`` section; replies without osvl's tags count as the
answer), or ``oracle`` (the path-oracle teacher; synthesized questions only, since it
needs each question's KG path).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from osvl import storage
from osvl.agent import evaluate as core  # core.evaluate_item at each call (tests/test_eval.py spies on it)
from osvl.agent.engines import EngineKind, VLLMOptions
from osvl.agent.env import build_env
from osvl.agent.evaluate import MODES, QUESTION_PREFIX, aliased, trained_tools
from osvl.agent.loop import AgentConfig
from osvl.agent.scripted import agent_tools, tiny_agent_checkpoint
from osvl.agent.teacher import PathOracle
from osvl.cluster import init_ray, interpreter_env
from osvl.config import RunConfig, from_dict, opt, run_dir, to_dict
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError, DataError
from osvl.eval.loaders import load_benchmark, load_image
from osvl.eval.report import write_reports
from osvl.logs import Progress
from osvl.metrics import Recorder, record_eval_item
from osvl.models.tiny import tiny_checkpoint
from osvl.tools.cache import CacheMode
from osvl.tools.outages import OutageConfig
from osvl.tools.registry import offered_tools
from osvl.tools.text_search import TextSearchConfig
from osvl.tracking import Tracker, tracked

logger = logging.getLogger(__name__)

JOB = "eval"
ITEMS = "items.jsonl"


@dataclass
class EvalConfig:
    """What to evaluate, how, and where the results go (``<run.root>/eval/<hash>/``)."""
    RENAMED: ClassVar[dict[str, str]] = {"num_actors": "workers", "cpus_per_actor": "cpus_per_worker",
                                         "inflight": "concurrency"}


    run: RunConfig = opt(RunConfig, "Run root and seed.")
    benchmarks: list[str] = opt([], "Benchmark files (JSONL, JSON or Parquet; see osvl/eval/loaders.py).")
    modes: list[str] = opt(["direct", "rag", "agentic"], "Modes to run: direct, rag, agentic.")
    model: str = opt("tiny-agent", "Checkpoint directory, 'tiny-agent', 'tiny', 'openai:NAME' or 'oracle'.")
    engine: EngineKind = opt("hf", "Token engine for a checkpoint.")
    vllm: VLLMOptions = opt(VLLMOptions, "engine=vllm: how the engine runs (dtype, max_model_len, GPU memory, CUDA "
                                         "graphs, tensor parallelism).")
    python: str = opt("", "Interpreter of the environment the evaluation actors run in (Ray's py_executable), for an "
                          "engine this one lacks: the vLLM environment's bin/python (make setup-vllm: "
                          ".venv-vllm/bin/python); empty = the job's own.", hashed=False)
    endpoint: EndpointConfig = opt(EndpointConfig, "openai:NAME models: the chat endpoint (endpoint.model is NAME: "
                                   "leave it empty or set the same).")
    processor: str = opt("", "Tokenizer/processor for chat models (openai, oracle); empty = the tiny checkpoint's.")
    image_root: str = opt("", "Folder the BrowseComp-VL / SimpleVQA image paths resolve under.", hashed=False)
    max_items: int = opt(0, "Items per benchmark (the first ones); 0 = all.")
    offer: list[str] = opt([], "Tools offered in agentic mode; empty = those of the model's training run "
                               "(osvl.agent.evaluate.trained_tools), else every tool.")
    schemas: str = opt("", "JSON file with the tool schemas to show the model (rollout.schemas' format); empty = "
                           "the registry's (the tiny agent: the short schemas it was fine-tuned with).")
    alias_set: str = opt("", "Tool-name alias set of a released checkpoint ('opensearch-vl': web_search, "
                             "layout_parsing and its question prefix); empty = osvl's names.")
    rag_top_k: int = opt(3, "top_k of the rag mode's image and text search.")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings (inprocess tools): the search engine the model was trained with "
        "(the GRPO job's rollout.text_search; dense_rerank: MiniLM re-rank of the BM25 hits, slow on CPU).")
    agent: AgentConfig = opt(AgentConfig(max_turns=6, max_new_tokens=128, max_episode_tokens=3072, temperature=0.0),
                             "Agent budgets (agentic mode; direct and rag use one turn of the same budgets).")
    judge: Literal["rule", "llm"] = opt("rule", "Answer judge: rule, or llm (the endpoint below; the rule judge "
                                                "runs too and the report gives their agreement).")
    judge_endpoint: EndpointConfig = opt(EndpointConfig, "The LLM judge's OpenAI-compatible endpoint.")
    tools: Literal["inprocess", "http"] = opt("inprocess", "Tool transport: inprocess (in each actor) or http (the "
                                                           "tool API at tools_url).")
    tools_url: str = opt("", "tools=http: the tool API's URL.", hashed=False)
    tool_cache: CacheMode = opt("replay", "Record/replay cache mode of tool calls (inprocess).")
    tool_cache_root: str = opt("", "Cache folder; empty = <run.root>/eval/tool_cache (shared by eval runs).",
                               hashed=False)
    tool_latency_s: float = opt(0.0, "Simulated extra latency per tool call (benchmarks), seconds.")
    outages: OutageConfig = opt(OutageConfig, "Seeded tool outages (osvl/tools/outages.py), agentic mode: how an "
                                "agent copes with flaky tools; off by default.")
    workers: int = opt(1, "Ray actors, each with one model and tool client.", hashed=False)
    cpus_per_worker: float = opt(1.0, "CPUs reserved per actor.", hashed=False)
    concurrency: int = opt(16, "Items each actor runs concurrently.", hashed=False)
    max_batch: int = opt(16, "Most turns a token engine batches into one generate.", hashed=False)


def check(cfg: EvalConfig) -> None:
    if not cfg.benchmarks:
        raise ConfigError("no benchmarks: pass --benchmarks=FILE[,FILE]")
    cfg.outages.check()
    bad = sorted(set(cfg.modes) - set(MODES))
    if bad or not cfg.modes:
        raise ConfigError(f"modes must be a non-empty subset of {MODES}, got {cfg.modes}")
    if cfg.model.startswith("openai:"):
        name = cfg.model.split(":", 1)[1]
        if cfg.endpoint.model not in ("", name):
            raise ConfigError(f"model {cfg.model!r} and endpoint.model {cfg.endpoint.model!r} name two models")
        baseline_endpoint(cfg).check("endpoint")
    if cfg.judge not in ("rule", "llm"):
        raise ConfigError(f"judge must be rule or llm, got {cfg.judge!r}")
    if cfg.tools not in ("inprocess", "http"):
        raise ConfigError(f"tools must be inprocess or http, got {cfg.tools!r}")
    if cfg.concurrency < 1 or cfg.workers < 1:
        raise ConfigError("concurrency and workers must be >= 1")
    interpreter_env(cfg.python, "python")  # a wrong interpreter fails here
    if cfg.engine == "vllm":
        cfg.vllm.check("vllm", cfg.agent.max_episode_tokens)
    if cfg.engine == "vllm" and not cfg.python and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine=vllm: vLLM is not installed in this environment; set python to the interpreter "
                          "of one that has it (make setup-vllm: .venv-vllm/bin/python)")
    cfg.agent.check()


def baseline_endpoint(cfg: EvalConfig) -> EndpointConfig:
    """The ``endpoint`` section with an ``openai:NAME`` model's NAME as the model sent."""
    return dataclasses.replace(cfg.endpoint, model=cfg.model.split(":", 1)[1])


def resolve_model(name: str) -> str:
    """A checkpoint directory for the names that stand for one (tiny, tiny-agent); others unchanged."""
    if name == "tiny":
        return str(tiny_checkpoint("qwen3_vl"))
    if name == "tiny-agent":
        return str(tiny_agent_checkpoint())
    return name


class EvalWorker:
    """One Ray actor: a model, a processor and a tool client; ``run`` scores a chunk of items."""

    def __init__(self, cfg: dict[str, Any], cache_root: str, model_path: str) -> None:
        import torch  # noqa: PLC0415 (d) keeps torch out of jobs/eval.py --help

        self.cfg = cfg = from_dict(EvalConfig, cfg)
        # a location (this node's mirror of a remote cache, filled with what other runs recorded)
        self.cache = cache_root = str(storage.attach(cache_root))
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        model = cfg.model
        chat = model == "oracle" or model.startswith("openai:")  # the oracle is bound to one question: no engine
        offer = cfg.offer if chat else cfg.offer or trained_tools(model_path)
        schemas = offered_tools(offer, cfg.schemas)
        if model == "tiny-agent" and not (cfg.offer or cfg.schemas):
            schemas = [t.schema for t in agent_tools().values()]  # the short schemas it was fine-tuned with
        self.tools, names = aliased(schemas, cfg.alias_set)
        self.prefix = QUESTION_PREFIX.get(cfg.alias_set, "")
        env = build_env(model="" if chat else model_path, engine=cfg.engine, max_batch=cfg.max_batch, vllm=cfg.vllm,
                        episode_tokens=cfg.agent.max_episode_tokens,
                        chat=baseline_endpoint(cfg) if model.startswith("openai:") else None, lenient=True,
                        transport=cfg.tools, url=cfg.tools_url, cache=cfg.tool_cache, cache_root=cache_root,
                        text_search=cfg.text_search, latency_s=cfg.tool_latency_s, aliases=names,
                        outages=cfg.outages, judge=cfg.judge_endpoint if cfg.judge == "llm" else None,
                        judge_cache=str(Path(cache_root).parent / "judge_cache.jsonl"))
        self.engine, self.client, self.judge = env.engine, env.client, env.llm_judge
        if chat:
            from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps torch out of jobs/eval.py --help

            self.processor = load_processor(model_path)
        else:
            self.processor = self.engine.processor

    async def _one(self, item: dict[str, Any], mode: str) -> dict[str, Any]:
        engine = self.engine
        try:
            if engine is None:  # the oracle is bound to one question

                engine = PathOracle(item)
            images = [await asyncio.to_thread(load_image, ref) for ref in item["images"]]
        except DataError as e:
            return {"id": item["id"], "mode": mode, "question": item["question"], "answer": item["answer"],
                    "prediction": None, "correct": 0.0, "rule_correct": 0.0, "llm_correct": None,
                    "judge_status": "rule", "failure": "item_error", "error": str(e)[:300], "turns": 0,
                    "tool_calls": 0, "tools": [], "fatal": False, "trajectory": []}
        res = await core.evaluate_item(engine, item, images, self.client, mode, self.cfg.agent,
                                       processor=self.processor, tools=self.tools, judge=self.judge,
                                       rag_top_k=self.cfg.rag_top_k, question_prefix=self.prefix)
        return res.record

    async def run(self, chunk: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Score ``chunk`` ((benchmark, mode, item) triples), ``concurrency`` at a time."""
        sem = asyncio.Semaphore(self.cfg.concurrency)

        async def one(bench: str, mode: str, item: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                t0 = time.perf_counter()
                rec = await self._one(item, mode)
                # the engine that answered, as this actor built it (a vLLM run shows VLLMEngine here)
                engine = type(self.engine).__name__ if self.engine is not None else "PathOracle"
                return {"benchmark": bench, "line": item.get("line"), "engine": engine, **rec,
                        "seconds": round(time.perf_counter() - t0, 3)}

        records = list(await asyncio.gather(*(one(b, m, it) for b, m, it in chunk)))
        if self.cfg.tools == "inprocess":
            storage.publish(self.cache)  # the calls recorded for this chunk, for the next run on any node
        return records


def read_items(path: Path) -> list[dict[str, Any]]:
    """The records of ``items.jsonl``; a line cut by a kill is ignored (its item is redone)."""
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _key(rec: dict[str, Any]) -> tuple[str, str, str]:
    return rec["benchmark"], rec["mode"], rec["id"]


@tracked(JOB)
def run(cfg: EvalConfig, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """The whole job; returns the summary (also written as summary.json)."""
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/eval.py --help

    check(cfg)
    t0 = time.perf_counter()
    out = run_dir(cfg, JOB).resolve()  # a local folder, or the node-local mirror of <root>/eval/<hash>/
    cache_root = cfg.tool_cache_root or storage.join(
        cfg.run.root if storage.is_uri(cfg.run.root) else str(Path(cfg.run.root).resolve()), JOB, "tool_cache")
    benches, names = [], set()
    for spec in cfg.benchmarks:
        b = load_benchmark(spec, cfg.image_root)
        while b.name in names:
            b.name += "_"
        names.add(b.name)
        if cfg.max_items:
            b.items = b.items[:cfg.max_items]
        log(f"eval: {b.name} ({b.format}): {len(b.items)} items, {len(b.problems)} rows not loadable"
            + (f" (first: line {b.problems[0]['line']}: {b.problems[0]['detail']})" if b.problems else ""))
        benches.append(b)
    items_file = out / ITEMS
    done = {_key(r) for r in read_items(items_file)}
    todo = [(b.name, m, it) for m in cfg.modes for b in benches for it in b.items if (b.name, m, it["id"]) not in done]
    log(f"eval: {len(done)} items already scored in {items_file}, {len(todo)} to go, model {cfg.model} -> {out}")
    if todo:
        init_ray(num_cpus=max(2, int(cfg.workers * cfg.cpus_per_worker) + 1))
        # API keys travel from the driver's environment to its actors, never through the config
        keys = {k: os.environ[k] for k in (cfg.endpoint.api_key_env, cfg.judge_endpoint.api_key_env)
                if k and k in os.environ}
        env = interpreter_env(cfg.python, "python") or {}
        if keys:
            env["env_vars"] = {**env.get("env_vars", {}), **keys}
        actor_cls = ray.remote(EvalWorker).options(num_cpus=cfg.cpus_per_worker, max_concurrency=4,
                                                   runtime_env=env or None)
        # built here, not in the actors: the tiny checkpoints build with asyncio.run, which an async actor cannot
        chat = cfg.model == "oracle" or cfg.model.startswith("openai:")
        path = cfg.processor or resolve_model("tiny") if chat else resolve_model(cfg.model)
        actors = [actor_cls.remote(to_dict(cfg), cache_root, path) for _ in range(min(cfg.workers, len(todo)))]
        metrics = Recorder(JOB, out.name)  # items done and Pass@1 so far, by benchmark and mode (dashboards/)
        size = cfg.concurrency
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        pending: dict[Any, int] = {}
        nxt = 0
        finished = 0
        with items_file.open("a", encoding="utf-8") as f, Progress(len(todo), "eval", "items") as bar:
            while nxt < len(chunks) or pending:
                while nxt < len(chunks) and len(pending) < 2 * len(actors):
                    pending[actors[nxt % len(actors)].run.remote(chunks[nxt])] = nxt
                    nxt += 1
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    pending.pop(ref)
                    for rec in ray.get(ref):
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        record_eval_item(metrics, *_key(rec)[:2], bool(rec["correct"]))
                        finished += 1
                        bar.update(1)
                    f.flush()
                    storage.publish(out, ITEMS)  # scored items survive losing this node: a rerun resumes
        for a in actors:
            ray.kill(a)
    records = read_items(items_file)
    summary = write_reports(out, records, benches, cfg.modes, extra={
        "model": cfg.model, "judge": cfg.judge, "evaluated_now": len(todo), "resumed": len(done),
        "seconds": round(time.perf_counter() - t0, 1), "config": to_dict(cfg)})
    log_scalars(out, cfg, summary)
    storage.publish(out)  # the event files with the rest
    log((out / "summary.md").read_text())
    return summary


def log_scalars(out: Path, cfg: EvalConfig, summary: dict[str, Any]) -> None:
    """Pass@1 (and fatal rate, mean turns and tool calls) of each benchmark and mode as tracked scalars at step 0,
    ``pass_at_1/<benchmark>/<mode>``: an eval is one point, which TensorBoard shows beside the training curves."""
    with Tracker.for_run(out, cfg.run, job=JOB, config=to_dict(cfg)) as tracker:
        tracker.log({f"{key}/{bench}/{mode}": t[key] for bench, entry in summary["benchmarks"].items()
                     for mode, t in entry["modes"].items()
                     for key in ("pass_at_1", "fatal_rate", "mean_turns", "mean_tool_calls")}, step=0)
