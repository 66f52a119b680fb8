"""Rollout actors: a token engine plus the agent loop, many groups and episodes in flight.

Each actor holds one engine (HF on CPU, vLLM on GPU) and runs ``groups_in_flight``
group workers on one asyncio loop; a group worker acquires a slot from the buffer
(which may make it wait: the staleness gate), makes sure the engine's weights are
at least ``Work.min_version``, runs the G episodes of the slot concurrently
through ``osvl.agent.loop.run_episode``, scores them with
``osvl.agent.reward.score_trajectory`` and hands the group to the buffer. With
several groups times G episodes in flight, the engine batches the turns of
whichever episodes are waiting for the model while the others wait for tools,
which is where the asynchronous design gets its throughput.

Weights arrive in the background (``osvl.rl.weights.Receiver``): over the learner's weight group,
or from the object store to catch up, applied between two engine steps; every turn records the
version it started with (the oldest that sampled it), which the staleness accounting counts.

Tools go through Ray Serve deployment handles (``tools=handle``) on a cluster, or
run in the actor's own process (``inprocess``, the single-machine default).

A dead actor: the trainer's monitor sees its ``run`` task fail, tells the buffer
(``release_actor``: its slots in flight are re-issued) and starts a replacement.
Images (the questions' and every tool-made one) are written once, by content
hash, into the run's image folder, which the learner reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from osvl import metrics as M
from osvl import storage
from osvl.agent import evaluate as core  # core.evaluate_item at each call (tests/test_eval.py spies on it)
from osvl.agent.engines import EngineKind, VLLMOptions
from osvl.agent.env import build_env
from osvl.agent.fatal import MaskStart
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.reward import RewardConfig, score_trajectory
from osvl.agent.trajectory import png_bytes, question_images
from osvl.cluster import interpreter_env, role_resources
from osvl.config import opt
from osvl.endpoint import EndpointConfig
from osvl.errors import ConfigError
from osvl.metrics import ENGINE_WEIGHT_UPDATE
from osvl.rl.weights import Receiver, digest
from osvl.tools.outages import OutageConfig
from osvl.tools.registry import offered_tools
from osvl.tools.text_search import TextSearchConfig


@dataclass
class RolloutConfig:
    """Rollout actors and the agent budgets they run with."""
    RENAMED: ClassVar[dict[str, str]] = {"num_actors": "workers", "cpus_per_actor": "cpus_per_worker"}


    workers: int = opt(1, "Rollout actors (each holds one engine).", hashed=False)
    cpus_per_worker: float = opt(1.0, "CPUs reserved per rollout actor.", hashed=False)
    num_gpus: float = opt(0.0, "GPUs per rollout actor and held-out evaluation engine (fractions share one).",
                          hashed=False)
    role_units: float = opt(0.0, "Units of the 'rollout' custom resource (osvl.cluster.ROLE_RESOURCES, declared on "
                                 "rollout nodes by cluster.yaml and deploy/) each rollout actor and evaluation "
                                 "engine requests; 0 = none.", hashed=False)
    engine: EngineKind = opt("hf", "Token engine: hf (transformers generate) or vllm.")
    max_batch: int = opt(32, "Most turns the engine batches into one generate call.", hashed=False)
    vllm: VLLMOptions = opt(VLLMOptions, "engine=vllm: how the engines run (dtype, max_model_len, GPU memory, CUDA "
                                         "graphs, tensor parallelism).")
    groups_in_flight: int = opt(2, "Groups each actor works on concurrently (x G episodes in flight).",
                                hashed=False)
    tools: Literal["inprocess", "handle"] = opt("inprocess", "Tool transport: inprocess (in the actor) or handle "
                                                             "(Ray Serve deployments).")
    offer: list[str] = opt([], "Tools offered to the policy, by name; empty = every registered tool.")
    schemas: str = opt("", "JSON file with the tool schemas to show the policy (a list of OpenAI-style function "
                           "schemas, e.g. the shorter descriptions a model was fine-tuned with); empty = the "
                           "registry's. Calls still run the registered tools.")
    text_search: TextSearchConfig = opt(
        TextSearchConfig, "text_search's settings for in-process tools (rollouts and held-out evaluation): those the "
        "SFT records were made with, which the GRPO job hands to the trajectories job it runs. With tools=handle the "
        "Serve app's settings apply (serve/).")
    tool_latency_s: float = opt(0.0, "Extra simulated latency added to every tool call (benchmarks), seconds.")
    outages: OutageConfig = opt(OutageConfig, "Seeded tool outages in the rollouts (osvl/tools/outages.py): the flaky "
                                "web tools fatal-step masking exists for; off by default. Held-out evaluation runs "
                                "without them.")
    agent: AgentConfig = opt(AgentConfig, "Budgets and fatal-step rules of every episode (the section the "
                             "trajectories job's agent: is).")
    reward: RewardConfig = opt(RewardConfig, "How every episode is scored (the section the trajectories job's "
                               "reward: is); reward.prefix_end is set from rl.mask_at. An LLM judge "
                               "(reward.judge llm or rule_then_llm, reward.query_scorer llm) is asked at judge:.")
    judge: EndpointConfig = opt(EndpointConfig, "Endpoint of the LLM answer/process judge, when reward asks for one "
                                "(the trajectories job's judge: section). A group with a sample it cannot judge "
                                "after the client's retries is dropped with reason judge_failed, never scored 0.")
    weight_poll_s: float = opt(10.0, "Long-poll timeout of the weight store, seconds.", hashed=False)
    python: str = opt("", "Interpreter of the environment the rollout actors and held-out evaluation run in (Ray's "
                          "py_executable), for an engine the job's own environment lacks: the vLLM environment's "
                          "bin/python (make setup-vllm: .venv-vllm/bin/python); empty = the job's own.", hashed=False)

    def check(self) -> None:
        self.agent.check()
        self.reward.check()
        self.outages.check()
        if self.reward.uses_llm():
            self.judge.check("rollout.judge")
        self.runtime_env()  # a wrong interpreter fails here, before any stage
        if self.engine == "vllm":
            self.vllm.check("rollout.vllm", self.agent.max_episode_tokens)
            tp = self.vllm.tensor_parallel_size
            if tp > 1 and self.num_gpus != tp:
                raise ConfigError(f"rollout.vllm.tensor_parallel_size={tp} needs rollout.num_gpus={tp} (each "
                                  f"engine's actor holds its GPUs), got {self.num_gpus:g}")
        if self.engine == "vllm" and not self.python and importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm: vLLM is not installed in this environment; set rollout.python to "
                              "the interpreter of one that has it (make setup-vllm: .venv-vllm/bin/python)")

    def runtime_env(self) -> dict[str, Any] | None:
        """The Ray runtime_env of the rollout actors and held-out evaluation tasks (``python``)."""
        return interpreter_env(self.python, "rollout.python")

    def actor_options(self) -> dict[str, Any]:
        """What each rollout actor and held-out evaluation task reserves (the launcher's Ray options, and
        ``--check``'s plan); the launcher adds ``runtime_env``."""
        return {"num_cpus": self.cpus_per_worker, "num_gpus": self.num_gpus,
                "resources": role_resources("rollout", self.role_units)}

    def episode_agent(self, greedy: bool = False) -> AgentConfig:
        """The agent section as an episode runs it: temperature 0 for evaluation."""
        return dataclasses.replace(self.agent, temperature=0.0 if greedy else self.agent.temperature)


@dataclass
class ActorStats:
    groups: int = 0
    episodes: int = 0
    refused: int = 0
    weight_updates: int = 0
    weight_sync_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)


class RolloutWorker:
    """One rollout actor (use through ``ray.remote``; every method runs on the actor's event loop)."""

    def __init__(self, actor_id: str, cfg: RolloutConfig, model_dir: str, questions: list[dict[str, Any]],
                 question_image_dir: str, image_dir: str, buffer: Any, store: Any, group_size: int,
                 mask_at: MaskStart = "cascade", recorder: Any = None) -> None:
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        self.id, self.cfg, self.G, self.mask_at = actor_id, cfg, group_size, mask_at
        self.buffer, self.store = buffer, store
        self.questions = questions
        # locations (osvl.storage): this actor may run on a node that holds no copy of the folders
        self.question_image_dir, self.image_dir = storage.attach(question_image_dir), storage.attach(image_dir)
        self.image_dir.mkdir(parents=True, exist_ok=True)
        self.rec = recorder
        # with tools=handle the Serve tool app's search settings apply; the judges' verdict cache lives in memory
        # for the actor's life: the G samples of a group that give the same answer, and a question asked again
        # at a later step, ask the endpoint once
        env = build_env(model=str(storage.attach(model_dir)), engine=cfg.engine, max_batch=cfg.max_batch, version=-1,
                        vllm=cfg.vllm, episode_tokens=cfg.agent.max_episode_tokens, transport=cfg.tools,
                        text_search=cfg.text_search, latency_s=cfg.tool_latency_s, recorder=recorder,
                        outages=cfg.outages, judge=cfg.judge if cfg.reward.uses_llm() else None)
        self.engine, self.client = env.engine, env.client
        self.llm_judge, self.process_judge = env.llm_judge, env.process_judge
        self.processor = self.engine.processor
        self.tools = offered_tools(cfg.offer, cfg.schemas)
        self.agent_cfg = cfg.episode_agent()
        self.stats = ActorStats()
        self._version_event: asyncio.Event | None = None
        self.newest_seen = -1  # newest published version the weight poll has returned
        self.in_flight = 0
        self._engine_seen: dict[str, int] = {}

    # -- metrics (osvl/metrics.py; skipped when the actor was built without a recorder) ----------

    def _record_episode(self, traj: Any) -> None:
        rec = self.rec
        rec.inc(M.ROLLOUT_EPISODES, 1, stop_reason=traj.stop_reason or "unknown")
        rec.observe(M.ROLLOUT_TURNS, len(traj.turns))
        rec.observe(M.ROLLOUT_TOOL_CALLS, sum(t.action == "tool_call" for t in traj.turns))
        rec.inc(M.ENGINE_TOKENS, sum(traj.gen_mask), phase="decode")

    def _record_engine(self) -> None:
        """What the engine reports about itself since the last call (the HF engine's prefill tokens and
        decoding steps; engines without those counters export decode tokens only) and the version lag."""
        rec, stats = self.rec, getattr(self.engine, "stats", {})
        delta = {k: stats.get(k, 0) - self._engine_seen.get(k, 0) for k in ("prefill_tokens", "steps", "row_steps")}
        self._engine_seen.update({k: stats.get(k, 0) for k in delta})
        rec.inc(M.ENGINE_TOKENS, delta["prefill_tokens"], phase="prefill")
        if delta["steps"] > 0 and "row_steps" in stats:
            rec.set(M.ENGINE_BATCH, delta["row_steps"] / delta["steps"], actor=self.id)
        rec.set(M.ENGINE_LAG, max(0, self.newest_seen - self.engine.version), actor=self.id)
        rec.set(M.ROLLOUT_IN_FLIGHT, self.in_flight, actor=self.id)

    async def _export_metrics(self, every_s: float = 5.0) -> None:
        while True:
            self._record_engine()
            await asyncio.sleep(every_s)

    # -- weights --------------------------------------------------------------

    async def _sync_weights(self) -> None:
        """Background: apply every version sent to this actor (``osvl.rl.weights.Receiver``)."""
        import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

        self.receiver = Receiver(self.store, self.id, ray.get_runtime_context().current_actor, self.engine,
                                 self.cfg.weight_poll_s)

        def applied(seconds: float) -> None:
            self.newest_seen = max(self.newest_seen, self.receiver.newest_seen)
            self.stats.weight_updates += 1
            self.stats.weight_sync_s += seconds
            if self.rec is not None:
                self.rec.observe(ENGINE_WEIGHT_UPDATE, seconds)
            self._version_event.set()
            self._version_event = asyncio.Event()

        await self.receiver.run(applied)

    async def _at_least(self, version: int) -> None:
        while self.engine.version < version:
            await self._version_event.wait()

    # -- groups ---------------------------------------------------------------

    async def _episode(self, work: Any, i: int) -> Any:
        row = self.questions[work.question_index]
        images = question_images(self.question_image_dir, row)
        store: dict = {}
        self.in_flight += 1
        try:
            traj = await run_episode(self.engine, row, images, self.client, self.agent_cfg, processor=self.processor,
                                     tools=self.tools, seed=work.seed + i, group_id=work.group_id, sample=i,
                                     image_store=store)
        finally:
            self.in_flight -= 1
        if self.rec is not None:
            self._record_episode(traj)
        # PNG encoding and the upload are seconds of blocking work at a remote root: off the loop, so the actor's
        # other episodes keep generating meanwhile
        await asyncio.to_thread(self._save_images, traj, store)
        scoring = dataclasses.replace(self.cfg.reward, prefix_end=self.mask_at)
        # a judge that stays unreachable marks the sample (judge_status="failed"); the buffer drops its group
        return await score_trajectory(traj, row, scoring, llm_judge=self.llm_judge, process_judge=self.process_judge)

    def _save_images(self, traj: Any, arrays: dict) -> None:
        """Write the episode's images (question + tool-made) once by hash where the learner reads them."""
        for sha in traj.images:
            if not (self.image_dir / f"{sha}.png").exists():
                storage.write_once(self.image_dir / f"{sha}.png", png_bytes(arrays[sha]))
        storage.publish(self.image_dir, *(f"{sha}.png" for sha in traj.images))  # for a learner on another node

    async def _group_worker(self) -> None:
        while True:
            work = await self.buffer.acquire.remote(self.id)
            if work is None:
                return
            await self._at_least(work.min_version)
            try:
                group = list(await asyncio.gather(*(self._episode(work, i) for i in range(self.G))))
                error = ""
            except Exception as e:  # noqa: BLE001 - a bad episode drops its group (with the reason), not the actor
                group, error = [], f"{type(e).__name__}: {e}"[:500]
            status = await self.buffer.put.remote(self.id, work.slot, work.attempt, group, error)
            self.stats.groups += 1
            self.stats.episodes += len(group)
            self.stats.statuses[status] = self.stats.statuses.get(status, 0) + 1

    async def run(self) -> dict[str, Any]:
        """Work until the buffer has issued every slot of the run; returns this actor's counters.

        After a normal finish the weight sync goes on until the actor is killed: the learner still trains
        the last groups, and the launcher checks that every engine ends on its final version
        (``osvl.rl.trainer.train``), which tests the weight path end to end."""
        self._version_event = asyncio.Event()
        sync = asyncio.create_task(self._sync_weights())
        self._sync_task = sync  # referenced, so the event loop keeps it after run() returns
        background = []
        if self.rec is not None:
            background.append(asyncio.create_task(self._export_metrics()))
        try:
            workers = asyncio.gather(*(self._group_worker() for _ in range(self.cfg.groups_in_flight)))
            await asyncio.wait({workers, sync}, return_when=asyncio.FIRST_COMPLETED)
            if not workers.done():  # the weight sync only ends by failing; the groups would wait for it forever
                workers.cancel()
                err = sync.exception()
                raise RuntimeError(f"rollout actor {self.id}: weight sync failed: {err!r}") from err
            await workers
        except BaseException:
            sync.cancel()
            raise
        finally:
            for task in background:
                task.cancel()
            if self.rec is not None:
                self._record_engine()  # the last figures (in flight back to 0)
        return self.get_stats()

    def get_stats(self, with_digest: bool = False) -> dict[str, Any]:
        """The actor's counters, and what its engine says of itself: which engine, its interpreter, its counters;
        ``with_digest``: also ``weights_sha256``, the hash of the engine's weights that the last version it
        received names (``osvl.rl.weights.digest``; HF engine only: vLLM renames and fuses them)."""
        receiver = getattr(self, "receiver", None)
        extra = {}
        if with_digest and hasattr(self.engine, "model") and receiver is not None:
            params = dict(self.engine.model.named_parameters())
            extra["weights_sha256"] = digest([(k, params[k]) for k in receiver.names])
        return {**extra, "actor": self.id, "version": self.engine.version, "engine": type(self.engine).__name__,
                "weights": dict(receiver.stats) if receiver is not None else {},
                "python": sys.executable, "model": str(getattr(self.engine, "path", "")),
                "engine_stats": dict(getattr(self.engine, "stats", {})),
                **self.stats.__dict__}

    def pid(self) -> int:
        return os.getpid()


async def _eval_episodes(model_dir: str, questions: list[dict[str, Any]], image_dir: str, cfg: RolloutConfig,
                         concurrency: int, modes: tuple[str, ...] = ("agentic",)) -> dict[str, list[float]]:
    # the rollouts' environment with in-process tools and without their outages, latency or judges
    env = build_env(model=model_dir, engine=cfg.engine, max_batch=cfg.max_batch, vllm=cfg.vllm,
                    episode_tokens=cfg.agent.max_episode_tokens, text_search=cfg.text_search)
    tools = offered_tools(cfg.offer, cfg.schemas)
    agent = cfg.episode_agent(greedy=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any], mode: str) -> float:
        async with sem:
            res = await core.evaluate_item(env.engine, row, question_images(Path(image_dir), row), env.client,
                                           mode, agent, processor=env.engine.processor, tools=tools)
            return float(res.record["correct"])

    try:
        return {mode: list(await asyncio.gather(*(one(r, mode) for r in questions))) for mode in modes}
    finally:
        await env.aclose()


def heldout_scores(model_dir: str | Path, questions: list[dict[str, Any]], image_dir: str | Path,
                   cfg: RolloutConfig, concurrency: int = 16,
                   modes: tuple[str, ...] = ("agentic",), workers: int = 0) -> dict[str, list[float]]:
    """Greedy per-question scores (1 correct, 0 not; rule judge) of ``model_dir`` on ``questions`` in each eval
    mode (``agentic``: the rollouts' budgets and offered tools; ``direct``: one turn, no tools), through the
    evaluator's per-item core (``osvl.agent.evaluate``). Pass@1 is their mean; the scores themselves are what
    a paired, seed-clustered comparison of two models needs (``osvl.rl.report.clustered_mean_se``).

    The engine runs in Ray tasks with the rollout actors' resources (a GPU node in production),
    never in the driver, which runs on the CPU-only head. ``workers`` tasks (0: one per rollout actor)
    each score a contiguous share of the questions: no rollout actor holds those resources while the
    job scores, and on CPU a task runs one engine thread per CPU it holds, so one task left the other
    cores idle (bench/heldout_eval.py).
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    def evaluate(model: str, images: str, share: list[dict[str, Any]]) -> dict[str, list[float]]:
        return asyncio.run(_eval_episodes(str(storage.attach(model)), share, str(storage.attach(images)), cfg,
                                          concurrency, modes))

    task = ray.remote(evaluate).options(name="heldout_eval", max_retries=1, runtime_env=cfg.runtime_env(),
                                        **cfg.actor_options())
    n = max(1, min(workers or cfg.workers, len(questions)))
    bounds = [len(questions) * i // n for i in range(n + 1)]
    model, images = storage.location(model_dir), storage.location(image_dir)
    parts = ray.get([task.remote(model, images, questions[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return {mode: [x for part in parts for x in part[mode]] for mode in modes}
