"""Every Prometheus metric osvl exports, declared in one place, and the one way to record them.

Metrics go through Ray's metric API (``ray.util.metrics``) so that Ray's per-node
metrics agent exports them next to Ray's own; Prometheus scrapes the agents and
``dashboards/`` reads them. Ray prefixes every user metric with ``ray_`` on export
and adds ``_total`` to counters, so ``osvl_tool_requests`` is scraped as
``ray_osvl_tool_requests_total``.

Labels: every series carries ``osvl_job`` (sft, grpo, synthesize, serve, eval, ...)
and ``run`` (the run's folder name: its config hash or ``run.name``), then its own
tags. Why not ``job``: Prometheus attaches ``job`` (the scrape job, "ray") to every
series it scrapes and renames a clashing label to ``exported_job``, so
``sum by (job)`` would mix SFT and GRPO. Why on every series, ratios included: two
runs on one cluster must stay two lines. Ray adds its own labels too (node, worker,
session); queries aggregate them away with ``sum by``/``max by``.

Recording goes through ``Recorder(job, run)``: it is two strings, so it pickles into
Ray actors and workers, and it fills the two labels on every call. Worker
processes are reused across runs (Ray Data tasks, Serve replicas), which is why the
labels travel with each call and not as a per-process default.

Why a table of specs and lazy objects instead of module-level ``Counter(...)``:
``import osvl.metrics`` must not start Ray or touch a Ray worker (it is imported
by tools, clients and jobs that may never run in a cluster), and Ray wants each
metric object created once per process. ``metric(SPEC)`` builds the Ray object on
first use in a process and caches it. Code that records does so through the
spec, so a typo in a metric name is an ``AttributeError`` at import time, not a
silently missing series.

Naming: ``osvl_<area>_<what>_<unit>`` (Prometheus conventions: base units,
seconds not milliseconds, counters without ``_total``). Areas: ``tool`` (the tool
API replicas), ``train`` (SFT and the GRPO learner), ``rl`` (GRPO), ``rollout``
(rollout actors and the driver's actor monitor), ``engine`` (the token engine of
each rollout actor), ``synth`` (question synthesis), ``eval`` (evaluation).
``dashboards/build.py`` makes one Grafana dashboard per area from these specs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

KINDS = ("counter", "gauge", "histogram")
LABELS = ("osvl_job", "run")  # on every series, before the metric's own tags


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    description: str
    tag_keys: tuple[str, ...] = ()  # LABELS first, then the metric's own tags
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown metric kind {self.kind!r}")
        if not self.name.startswith("osvl_"):
            raise ValueError(f"{self.name}: osvl metric names start with 'osvl_'")
        if self.kind == "histogram" and not self.boundaries:
            raise ValueError(f"{self.name}: a histogram needs bucket boundaries")
        if self.tag_keys[:len(LABELS)] != LABELS or "job" in self.tag_keys:
            raise ValueError(f"{self.name}: tags must start with {LABELS} and never be 'job' (Prometheus's own)")

    @property
    def own_tags(self) -> tuple[str, ...]:
        """The metric's tags after ``osvl_job`` and ``run``."""
        return self.tag_keys[len(LABELS):]


SPECS: dict[str, MetricSpec] = {}


def _define(name: str, kind: str, description: str, tag_keys: tuple[str, ...] = (),
            boundaries: tuple[float, ...] = ()) -> MetricSpec:
    if name in SPECS:
        raise ValueError(f"metric {name} defined twice")
    spec = MetricSpec(name, kind, description, LABELS + tuple(tag_keys), boundaries)
    SPECS[name] = spec
    return spec


# ---------------------------------------------------------------------------
# tools (serve/app.py records these inside every tool replica, so handle and HTTP
# callers are counted alike)

TOOL_REQUESTS = _define(
    "osvl_tool_requests", "counter",
    "Tool calls finished, by tool and result status (ok, invalid_call, tool_error, timeout, unavailable).",
    ("tool", "status"))
TOOL_LATENCY = _define(
    "osvl_tool_latency_seconds", "histogram",
    "Wall time of one tool call inside its replica, in seconds (queueing in the replica included).",
    ("tool",), (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
TOOL_IN_FLIGHT = _define(
    "osvl_tool_in_flight_requests", "gauge",
    "Tool calls currently running in one replica, in requests.",
    ("tool", "replica"))
TOOL_BATCH_SIZE = _define(
    "osvl_tool_batch_size_requests", "histogram",
    "Requests per executed batch of a batched tool (EDSR, OCR), in requests.",
    ("tool",), (1, 2, 4, 8, 16, 32, 64))

# ---------------------------------------------------------------------------
# training (osvl/train: SFT, and the GRPO learner with osvl_job="grpo"); rank 0 records them

TRAIN_LOSS = _define(
    "osvl_train_loss", "gauge",
    "Training loss of the last optimizer step (SFT: token-mean NLL over generated tokens).")
TRAIN_VAL_LOSS = _define(
    "osvl_train_val_loss", "gauge",
    "Validation loss on held-out trajectories (token-mean NLL over generated tokens).")
TRAIN_TOKENS_PER_S = _define(
    "osvl_train_tokens_per_second", "gauge",
    "Training throughput over all workers, in tokens (padding excluded) per second.")
TRAIN_LR = _define(
    "osvl_train_learning_rate", "gauge", "Learning rate of the last optimizer step.")
TRAIN_GRAD_NORM = _define(
    "osvl_train_grad_norm", "gauge", "Global gradient norm of the last optimizer step, before clipping.")

# ---------------------------------------------------------------------------
# GRPO (osvl/rl): the learner's rank 0 records these once per step, from the step's groups

RL_REWARD = _define(
    "osvl_rl_reward", "gauge",
    "Mean reward part over the trajectories of the last step (part: reward, r_fmt, r_acc, r_query).", ("part",))
RL_ACCURACY = _define(
    "osvl_rl_accuracy_ratio", "gauge", "Share of the last step's trajectories with r_acc = 1.")
RL_FATAL_RATE = _define(
    "osvl_rl_fatal_ratio", "gauge", "Share of the last step's trajectories that hit K consecutive failures.")
RL_CLAMPED = _define(
    "osvl_rl_fatal_trajectories", "counter",
    "Fatal trajectories by what the one-sided clamp did (split: clamped to 0, kept_positive).", ("split",))
RL_MASK_COVERAGE = _define(
    "osvl_rl_mask_coverage_ratio", "gauge", "Share of generated tokens of the last step that received gradient.")
RL_STALENESS = _define(
    "osvl_rl_staleness_groups", "gauge",
    "Groups trained so far by staleness (learner step minus the oldest turn's policy version).", ("staleness",))
RL_KL = _define(
    "osvl_rl_kl", "gauge", "Mean k3 KL of the policy to the frozen reference on trained tokens (last step).")
RL_CLIP_FRACTION = _define(
    "osvl_rl_clip_fraction_ratio", "gauge", "Share of trained tokens whose importance ratio was clipped.")
RL_ENTROPY = _define(
    "osvl_rl_entropy_nats", "gauge", "Mean next-token entropy on trained tokens (last step), in nats.")
RL_TOKENS_PER_S = _define(
    "osvl_rl_learner_tokens_per_second", "gauge", "Learner throughput of the last step, generated tokens per second.")
RL_STEP_TIME = _define(
    "osvl_rl_step_seconds", "histogram", "Wall time of one learner update (forward, backward, optimizer), seconds.",
    (), (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
RL_WEIGHT_SYNC = _define(
    "osvl_rl_weight_sync_seconds", "histogram", "Time to publish one weights version to the object store, seconds.",
    (), (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
RL_BUFFER_DEPTH = _define(
    "osvl_rl_buffer_depth_groups", "gauge", "Finished groups waiting in the trajectory buffer.")
RL_RESAMPLED = _define(
    "osvl_rl_resampled_groups", "gauge",
    "Groups thrown away so far because every sample had the same accuracy, their slots re-issued with the next "
    "question (train.resample_flat).")
RL_SKIPPED = _define(
    "osvl_rl_skipped_steps", "counter", "Learner steps skipped because the loss or a gradient was not finite.")

RL_STEPS_LEFT = _define(
    "osvl_rl_steps_remaining", "gauge", "Learner steps still to run (0 once the run has trained its last step).")
RL_LAST_STEP = _define(
    "osvl_rl_last_step_timestamp_seconds", "gauge",
    "Unix time of the learner's last finished step (a stalled learner: time() minus this grows).")
RL_STALENESS_NOW = _define(
    "osvl_rl_oldest_staleness_versions", "gauge",
    "Staleness of the last step's oldest turn: learner version minus the oldest turn's policy version.")
RL_LIMIT = _define(
    "osvl_rl_limit", "gauge",
    "The run's configured bounds (limit: kl_max, entropy_min, entropy_max, max_staleness; 0 = no bound), "
    "so alerts compare against the run's own settings.", ("limit",))

# ---------------------------------------------------------------------------
# rollout (osvl/rl/rollout.py records per episode and per tool call; the driver's monitor the actors)

ROLLOUT_EPISODES = _define(
    "osvl_rollout_episodes", "counter", "Episodes finished by the rollout actors, by stop reason.", ("stop_reason",))
ROLLOUT_TURNS = _define(
    "osvl_rollout_turns_per_episode", "histogram", "Assistant turns of one finished episode.",
    (), (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
ROLLOUT_TOOL_CALLS = _define(
    "osvl_rollout_tool_calls_per_episode", "histogram", "Tool calls of one finished episode.",
    (), (1, 2, 3, 4, 6, 8, 12, 16))  # Ray wants positive bounds: le="1" holds episodes with 0 or 1
ROLLOUT_TOOL_RESULTS = _define(
    "osvl_rollout_tool_results", "counter",
    "Tool calls as the agent sees them (after the client's retries), by tool and status (ok, or the error "
    "kind: invalid_call, tool_error, timeout, unavailable).", ("tool", "status"))
ROLLOUT_TOOL_LATENCY = _define(
    "osvl_rollout_tool_latency_seconds", "histogram",
    "Wall time of one tool call as the agent sees it (transport and retries included), in seconds.",
    ("tool",), (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
ROLLOUT_IN_FLIGHT = _define(
    "osvl_rollout_episodes_in_flight", "gauge", "Episodes one rollout actor is running now.", ("actor",))
ROLLOUT_ACTORS_LIVE = _define(
    "osvl_rollout_actors_live", "gauge", "Rollout actors running now (the driver's monitor).")
ROLLOUT_RESTARTS = _define(
    "osvl_rollout_actor_restarts", "gauge",
    "Rollout actors that died and were replaced so far in this run. A gauge, set to 0 at the start, so the "
    "first death is a visible change (a counter's series would only appear with it).")

# ---------------------------------------------------------------------------
# engines (the token engine inside each rollout actor; the actor records what its engine did)

ENGINE_TOKENS = _define(
    "osvl_engine_tokens", "counter",
    "Tokens the engine processed, by phase: prefill (prompt tokens it computed, prefix-cache hits excluded; "
    "engines that report it) and decode (sampled tokens).", ("phase",))
ENGINE_BATCH = _define(
    "osvl_engine_batch_size_turns", "gauge",
    "Mean turns decoded together per decoding step since the last export (engines that report it).", ("actor",))
ENGINE_WEIGHT_UPDATE = _define(
    "osvl_engine_weight_update_seconds", "histogram",
    "Time from a new weights version being seen to the engine sampling with it (fetch and load), seconds.",
    (), (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
ENGINE_LAG = _define(
    "osvl_engine_policy_lag_versions", "gauge",
    "Newest published policy version minus the version the engine samples with.", ("actor",))

# ---------------------------------------------------------------------------
# synthesis (osvl/synth/pipeline.py)

SYNTH_ROWS = _define(
    "osvl_synth_rows", "counter",
    "Rows out of each synthesis stage (stage: seeds walked, questions made by the shards, kept after the "
    "filter slot and the share caps).", ("stage",))
SYNTH_DROPPED = _define(
    "osvl_synth_dropped_rows", "counter",
    "Walks, drafts and rows dropped by synthesis, by stage and reason (the data card's drop table).",
    ("stage", "reason"))

# ---------------------------------------------------------------------------
# evaluation (osvl/eval records through record_eval_item)

EVAL_ITEMS = _define(
    "osvl_eval_items", "counter", "Evaluation items finished, by benchmark, mode and result (correct, wrong).",
    ("benchmark", "mode", "result"))
EVAL_PASS1 = _define(
    "osvl_eval_pass_at_1_ratio", "gauge",
    "Pass@1 over the items this process has finished so far, by benchmark and mode.", ("benchmark", "mode"))

# ---------------------------------------------------------------------------

_objects: dict[str, Any] = {}


def metric(spec: MetricSpec) -> Any:
    """The process-wide Ray metric object of ``spec``, created on first use."""
    obj = _objects.get(spec.name)
    if obj is None:
        from ray.util import metrics as ray_metrics  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help

        if spec.kind == "counter":
            obj = ray_metrics.Counter(spec.name, spec.description, tag_keys=spec.tag_keys)
        elif spec.kind == "gauge":
            obj = ray_metrics.Gauge(spec.name, spec.description, tag_keys=spec.tag_keys)
        else:
            obj = ray_metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries),
                                        tag_keys=spec.tag_keys)
        _objects[spec.name] = obj
    return obj


def prometheus_name(spec: MetricSpec) -> str:
    """The series name Prometheus sees for ``spec`` (Ray's ``ray_`` prefix, ``_total`` on counters)."""
    return "ray_" + spec.name + ("_total" if spec.kind == "counter" else "")


@dataclass(frozen=True)
class Recorder:
    """Records osvl metrics with one run's ``osvl_job`` and ``run`` labels (picklable: pass it to actors).

    ``tags`` are the metric's own tags (``MetricSpec.own_tags``); a missing or unknown one
    raises ``ValueError`` here rather than in Ray's exporter.
    """

    job: str
    run: str

    def _tags(self, spec: MetricSpec, tags: dict[str, Any]) -> dict[str, str]:
        if set(tags) != set(spec.own_tags):
            raise ValueError(f"{spec.name} takes tags {spec.own_tags}, got {tuple(tags)}")
        return {"osvl_job": self.job, "run": self.run, **{k: str(v) for k, v in tags.items()}}

    def set(self, spec: MetricSpec, value: float, **tags: Any) -> None:
        metric(spec).set(float(value), tags=self._tags(spec, tags))

    def inc(self, spec: MetricSpec, value: float = 1.0, **tags: Any) -> None:
        """Add ``value`` to a counter; 0 is a no-op (Ray's counters refuse it)."""
        if value > 0:
            metric(spec).inc(float(value), tags=self._tags(spec, tags))

    def observe(self, spec: MetricSpec, value: float, **tags: Any) -> None:
        metric(spec).observe(float(value), tags=self._tags(spec, tags))


_eval_tally: dict[tuple[str, ...], list[int]] = {}
_eval_lock = threading.Lock()


def record_eval_item(rec: Recorder, benchmark: str, mode: str, correct: bool) -> float:
    """Count one finished evaluation item and update Pass@1 so far; returns that Pass@1.

    The tally is per process and per (job, run, benchmark, mode): an evaluation spread
    over several processes exports one Pass@1 line per process (``osvl_eval_items`` is
    the exact total across them).
    """
    key = (rec.job, rec.run, benchmark, mode)
    with _eval_lock:
        done = _eval_tally.setdefault(key, [0, 0])
        done[0] += 1
        done[1] += bool(correct)
        pass1 = done[1] / done[0]
    rec.inc(EVAL_ITEMS, 1, benchmark=benchmark, mode=mode, result="correct" if correct else "wrong")
    rec.set(EVAL_PASS1, pass1, benchmark=benchmark, mode=mode)
    return pass1
