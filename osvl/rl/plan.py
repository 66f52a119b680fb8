"""``jobs/grpo.py --check``: the plan of a GRPO run on a cluster, and what would break there, without starting it.

Per role it prints what the launcher would ask Ray for (read from the functions the launcher calls:
``RolloutConfig.actor_options``, ``osvl.train.deepspeed.worker_bundle``), the engine's arguments
(``osvl.agent.engines.vllm_args``, as a GPU machine derives them), the dtypes, and the memory each
GPU would need, from the model's ``config.json`` (its parameters counted on the meta device, so
nothing is allocated) and the profile's lengths. Then one line per inconsistency; any makes the check
exit non-zero. What is estimated, and how:

- learner, per GPU: the weights and gradients in the training dtype (bf16 by default on GPUs,
  ``learner.bf16``; then also DeepSpeed's fp32 master weights) and AdamW's two fp32 moments, divided
  over the ranks where ZeRO partitions them (stage 3: all; stage 2: gradients, master weights and
  moments); activations of one micro-batch at its ceiling, max(``rl.micro_tokens``, ``rl.max_len``)
  (a group may be split over micro-batches; one row is never split), with gradient checkpointing (each
  layer's input kept, one layer's activations recomputed at a time) or without (every layer's), at
  Korthikanti et al.'s 34 x hidden bytes per token and layer at 16 bits; the float32 logits of the
  generated positions at most (every token). An upper bound, not a forecast.
- reference model (``rl.beta`` > 0): built as the policy is (``osvl.rl.learner_loop.reference_model``),
  in the training dtype on the GPU, partitioned under ZeRO-3.
- rollout, per GPU: vLLM takes ``gpu_memory_utilization`` of the device; the weights (16-bit on a GPU)
  split over the tensor-parallel ranks, and the rest is KV cache, counted in full-length sequences.

Cluster shapes come from ``cluster.yaml`` (node types, their role resources, and the instance types
below) or a KubeRay manifest of ``deploy/`` (worker groups' ``rayStartParams.resources`` and container
limits; GPU memory from ``gpu_memory_gb``, since a manifest does not say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from osvl.agent.engines import vllm_args
from osvl.cluster import ROLE_RESOURCES
from osvl.errors import ConfigError
from osvl.train.deepspeed import worker_bundle

GB = 1024 ** 3

# AWS instance types cluster.yaml names: (vCPUs, GPUs, GiB per GPU, host GiB)
INSTANCES = {"m6i.4xlarge": (16, 0, 0, 64), "m6i.8xlarge": (32, 0, 0, 128), "g5.2xlarge": (8, 1, 24, 32),
             "g5.12xlarge": (48, 4, 24, 192), "p4d.24xlarge": (96, 8, 40, 1152), "p4de.24xlarge": (96, 8, 80, 1152),
             "p5.48xlarge": (192, 8, 80, 2048)}


@dataclass
class NodeType:
    name: str
    cpus: float
    gpus: int
    gpu_gb: float
    host_gb: float
    resources: dict[str, float] = field(default_factory=dict)  # custom (role) resources


def read_cluster(path: str | Path, gpu_memory_gb: float = 80.0) -> list[NodeType]:
    """The node types of ``cluster.yaml`` or of a KubeRay RayCluster / RayJob manifest."""
    doc = yaml.safe_load(Path(path).read_text())
    if "available_node_types" in doc:
        nodes = []
        for name, spec in doc["available_node_types"].items():
            kind = (spec.get("node_config") or {}).get("InstanceType", "")
            if kind not in INSTANCES:
                raise ConfigError(f"{path}: node type {name}: unknown instance type {kind!r}; known: "
                                  f"{', '.join(INSTANCES)}")
            cpus, gpus, gpu_gb, host_gb = INSTANCES[kind]
            res = {k: float(v) for k, v in (spec.get("resources") or {}).items() if k not in ("CPU", "GPU")}
            nodes.append(NodeType(name, float(spec.get("resources", {}).get("CPU", cpus)), gpus, gpu_gb, host_gb, res))
        return nodes
    spec = doc.get("spec", {})
    spec = spec.get("rayClusterSpec", spec)
    nodes = []
    for group in spec.get("workerGroupSpecs", []):
        raw = str(group.get("rayStartParams", {}).get("resources", "{}")).strip("'\"").replace('\\"', '"')
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        gpus = int(limits.get("nvidia.com/gpu", 0))
        nodes.append(NodeType(group["groupName"], float(limits.get("cpu", 0)), gpus, gpu_memory_gb if gpus else 0,
                              _gib(limits.get("memory", "0")), {k: float(v) for k, v in json.loads(raw).items()}))
    if not nodes:
        raise ConfigError(f"{path}: neither cluster.yaml's available_node_types nor KubeRay workerGroupSpecs")
    return nodes


def _gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Ti": 1024.0, "Mi": 1 / 1024, "G": 1e9 / GB}
    for suffix, scale in units.items():
        if str(quantity).endswith(suffix):
            return float(str(quantity)[: -len(suffix)]) * scale
    return float(quantity) / GB


@dataclass
class ModelShape:
    params: int            # all parameters
    vision: int            # those of the vision tower
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int


def model_shape(config_json: str | Path) -> ModelShape:
    """Counted on the meta device from a checkpoint's ``config.json`` (nothing allocated, nothing downloaded)."""
    # lazy: (d) keeps transformers out of jobs/grpo.py --help
    from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: PLC0415

    cfg = AutoConfig.from_pretrained(Path(config_json).parent if Path(config_json).is_file() else config_json)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    text = cfg.text_config
    return ModelShape(params=sum(p.numel() for p in model.parameters()),
                      vision=sum(p.numel() for k, p in model.named_parameters() if ".visual." in f".{k}"),
                      hidden=text.hidden_size, layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads,
                      head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                      vocab=text.vocab_size)


def learner_gpu_bytes(shape: ModelShape, tokens: int, world: int, zero_stage: int, *,
                      bf16: bool, grad_checkpointing: bool, reference: bool) -> dict[str, float]:
    """Per learner GPU, in bytes, for a micro-batch of ``tokens``, every one of them scored (see the module
    docstring)."""
    p, w = shape.params, 2 if bf16 else 4

    def split(stage: int) -> int:
        return world if zero_stage >= stage else 1

    states = {"weights": p * w / split(3)}
    if bf16:
        states["fp32 master weights"] = p * 4 / split(1)
    states["gradients"] = p * w / split(2)
    states["adam moments"] = 2 * p * 4 / split(1)
    if reference:
        states["reference"] = p * w / split(3)
    layer = tokens * shape.hidden * 34 * w / 2  # one layer's activations at this dtype
    states["activations"] = (tokens * shape.layers * shape.hidden * w + layer if grad_checkpointing
                             else layer * shape.layers)
    states["logits"] = tokens * shape.vocab * 4.0
    return states


def learner_tokens(cfg: Any) -> int:
    """Tokens of a learner micro-batch at its ceiling (see the module docstring)."""
    rl = cfg.rl
    if rl.micro_tokens:  # rows fill the budget; a row over it (at most max_len) is a micro-batch alone
        tokens = max(rl.micro_tokens, rl.max_len)
    else:  # one batch per rank: its share of the step's groups, every row at max_len
        tokens = -(-cfg.train.groups_per_step // cfg.learner.workers) * rl.group_size * rl.max_len
    return tokens


def check(cfg: Any, shape: ModelShape, nodes: list[NodeType], out: Any = print) -> list[str]:
    """Print the plan of GRPO config ``cfg`` on ``nodes``; return the inconsistencies (one line each)."""
    rc, lc, rl = cfg.rollout, cfg.learner, cfg.rl
    problems: list[str] = []
    gpu_nodes = [n for n in nodes if n.gpus]
    out(f"model: {shape.params / 1e9:.2f} B parameters ({shape.vision / 1e9:.2f} B vision), {shape.layers} layers, "
        f"hidden {shape.hidden}")
    out("nodes: " + "; ".join(f"{n.name} {n.cpus:g} CPU, {n.gpus} GPU x {n.gpu_gb:g} GiB, {n.resources}"
                              for n in nodes))

    def offered(role: str, units: float) -> None:
        if units > 0 and not any(n.resources.get(ROLE_RESOURCES[role], 0) >= units for n in nodes):
            problems.append(f"{role}: {units:g} unit(s) of the '{ROLE_RESOURCES[role]}' resource asked, no node type "
                            "offers that many")

    # rollout
    opts = rc.actor_options()
    out(f"rollout: {rc.workers} actor(s), each {{CPU: {opts['num_cpus']:g}, GPU: {opts['num_gpus']:g}, "
        f"{opts['resources']}}}, engine {rc.engine}, interpreter {rc.python or '(the job’s own)'}")
    offered("rollout", rc.role_units)
    if rc.engine == "vllm":
        args = vllm_args(rc.vllm, rc.agent.max_episode_tokens, gpu=bool(gpu_nodes))
        out(f"  vLLM arguments: {args}, max_num_seqs {rc.max_batch}")
        try:
            rc.vllm.check("rollout.vllm", rc.agent.max_episode_tokens)
        except ConfigError as e:
            problems.append(str(e))
        if gpu_nodes and rc.num_gpus <= 0:
            problems.append("rollout.num_gpus=0 with engine vllm on a GPU cluster: the engines would start without "
                            "a GPU")
        # without role units an actor may land on any GPU node type: the smallest GPU is the one to size for
        hosts = [n for n in gpu_nodes if not rc.role_units or n.resources.get(ROLE_RESOURCES["rollout"], 0)]
        if rc.num_gpus > 0 and hosts:
            gpu = min(n.gpu_gb for n in hosts) * GB
            tp = rc.vllm.tensor_parallel_size
            weights = shape.params * (4 if args["dtype"] == "float32" else 2) / tp
            kv_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 / tp
            budget = rc.vllm.gpu_memory_utilization * gpu - weights
            seqs = budget / (kv_token * args["max_model_len"])
            out(f"  per GPU: weights {weights / GB:.1f} GiB, KV cache {max(budget, 0) / GB:.1f} GiB = {seqs:.1f} "
                f"sequences of {args['max_model_len']} tokens (of {gpu / GB:g} GiB)")
            if seqs < 1:
                problems.append(f"rollout: the weights leave no room for one {args['max_model_len']}-token sequence "
                                f"in {rc.vllm.gpu_memory_utilization:g} of a {gpu / GB:g} GiB GPU")
    # learner
    bundle = worker_bundle(lc.threads_per_worker, lc.use_gpu, lc.role_units)
    bf16 = lc.bf16 if lc.bf16 is not None else lc.use_gpu
    out(f"learner: {lc.workers} worker(s), each {bundle}, ZeRO-{lc.zero_stage}, "
        + ("bf16 weights, fp32 master weights and moments" if bf16 else "float32 weights and moments")
        + (", gradient checkpointing" if lc.grad_checkpointing else "")
        + ("" if lc.role_units else " (learner.role_units 0: any node type may host a worker)"))
    offered("learner", lc.role_units)
    hosts = [n for n in (gpu_nodes if lc.use_gpu else nodes)
             if not lc.role_units or n.resources.get(ROLE_RESOURCES["learner"], 0) >= lc.role_units]
    if lc.use_gpu and hosts:
        most = max(n.gpus for n in hosts)
        if lc.workers > most:
            problems.append(f"learner: {lc.workers} workers need {lc.workers} GPUs on one node; the largest "
                            f"learner node type has {most}")
        tokens = learner_tokens(cfg)
        need = learner_gpu_bytes(shape, tokens, lc.workers, lc.zero_stage, bf16=bf16,
                                 grad_checkpointing=lc.grad_checkpointing, reference=rl.beta > 0)
        gpu = min(n.gpu_gb for n in hosts) * GB
        out(f"  micro-batch ceiling: {tokens} tokens")
        out("  per GPU: " + ", ".join(f"{k} {v / GB:.1f} GiB" for k, v in need.items())
            + f" = {sum(need.values()) / GB:.1f} GiB (of {gpu / GB:g} GiB)")
        if sum(need.values()) > gpu:
            problems.append(f"learner: {sum(need.values()) / GB:.0f} GiB per GPU needed (micro-batch of up to "
                            f"{tokens} tokens, {'bf16' if bf16 else 'float32'}, gradient checkpointing "
                            f"{'on' if lc.grad_checkpointing else 'off'}), above the {gpu / GB:g} GiB of a GPU")
    # data stages the job chains (osvl.recipe.GRPOJobConfig's typed sections)
    for section in ("synth", "trajectories"):
        offered("data", float(getattr(getattr(cfg, section, None), "role_units", 0) or 0))
    return problems


def run_check(cfg: Any, model: str, cluster: str | Path, gpu_memory_gb: float = 80.0, out: Any = print) -> int:
    """``jobs/grpo.py --check``: print the plan, then each inconsistency on a line of its own; the exit code.

    ``model`` is a checkpoint directory or its ``config.json`` (empty: ``cfg.model`` when it is a local
    directory). Checks that need the cluster's own files (``rollout.python``, the model's weights) are
    left to the job's start, where they run anyway."""
    cfg.rollout.agent.check()
    cfg.rollout.reward.check()
    where = Path(model or cfg.model)
    if not (where / "config.json").is_file() and not (where.is_file() and where.name == "config.json"):
        raise ConfigError(f"--check needs the model's config.json: --check=DIR (a checkpoint directory, or one of "
                          f"configs/models/); got {str(where)!r}")
    out(f"check: profile model {cfg.model or '(built by the job)'}, sizes from {where}, cluster {cluster}")
    problems = check(cfg, model_shape(where), read_cluster(cluster, gpu_memory_gb), out)
    for line in problems:
        out(f"check: FAIL {line}")
    out("check: OK" if not problems else f"check: {len(problems)} problem(s)")
    return 1 if problems else 0
