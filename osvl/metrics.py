"""Every Prometheus metric osvl exports, declared in one place.

Metrics go through Ray's metric API (``ray.util.metrics``) so that Ray's per-node
metrics agent exports them next to Ray's own; Prometheus scrapes the agents and
``dashboards/`` reads them. Ray prefixes every user metric with ``ray_`` on export
and adds ``_total`` to counters, so ``osvl_tool_requests`` is scraped as
``ray_osvl_tool_requests_total``.

Why a table of specs and lazy objects instead of module-level ``Counter(...)``:
``import osvl.metrics`` must not start Ray or touch a Ray worker (it is imported
by tools, clients and jobs that may never run in a cluster), and Ray wants each
metric object created once per process. ``metric(SPEC)`` builds the Ray object on
first use in a process and caches it. Code that records does so through the
spec, so a typo in a metric name is an ``AttributeError`` at import time, not a
silently missing series.

Naming: ``osvl_<area>_<what>_<unit>`` (Prometheus conventions: base units,
seconds not milliseconds, counters without ``_total``). Areas: ``tool`` (the
tool API, serve/ and osvl.tools.client); training (``osvl_train_*``) and rollout
(``osvl_rollout_*``) metrics are added below their own heading when those parts
land, with the same ``_define`` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown metric kind {self.kind!r}")
        if not self.name.startswith("osvl_"):
            raise ValueError(f"{self.name}: osvl metric names start with 'osvl_'")
        if self.kind == "histogram" and not self.boundaries:
            raise ValueError(f"{self.name}: a histogram needs bucket boundaries")


SPECS: dict[str, MetricSpec] = {}


def _define(name: str, kind: str, description: str, tag_keys: tuple[str, ...] = (),
            boundaries: tuple[float, ...] = ()) -> MetricSpec:
    if name in SPECS:
        raise ValueError(f"metric {name} defined twice")
    spec = MetricSpec(name, kind, description, tag_keys, boundaries)
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
# training (osvl/train: SFT, and the GRPO learner with job="grpo"); rank 0 records them

TRAIN_LOSS = _define(
    "osvl_train_loss", "gauge",
    "Training loss of the last optimizer step (SFT: token-mean NLL over generated tokens).", ("job",))
TRAIN_VAL_LOSS = _define(
    "osvl_train_val_loss", "gauge",
    "Validation loss on held-out trajectories (token-mean NLL over generated tokens).", ("job",))
TRAIN_TOKENS_PER_S = _define(
    "osvl_train_tokens_per_second", "gauge",
    "Training throughput over all workers, in tokens (padding excluded) per second.", ("job",))
TRAIN_LR = _define(
    "osvl_train_learning_rate", "gauge", "Learning rate of the last optimizer step.", ("job",))
TRAIN_GRAD_NORM = _define(
    "osvl_train_grad_norm", "gauge", "Global gradient norm of the last optimizer step, before clipping.", ("job",))

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
RL_SKIPPED = _define(
    "osvl_rl_skipped_steps", "counter", "Learner steps skipped because the loss or a gradient was not finite.")

# ---------------------------------------------------------------------------

_objects: dict[str, Any] = {}


def metric(spec: MetricSpec) -> Any:
    """The process-wide Ray metric object of ``spec``, created on first use."""
    obj = _objects.get(spec.name)
    if obj is None:
        from ray.util import metrics as ray_metrics

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
