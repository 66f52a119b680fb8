"""Supervised fine-tuning on trajectory records: Ray Train workers, DeepSpeed ZeRO, Ray Data input.

What one run does (``jobs/sft.py`` parses the config and calls ``run``):

1. The driver finds the trajectory table (a ``write_trajectories`` folder; a ShareGPT release
   file is first imported into one), splits questions into train and validation by a hash of
   the question id (no question is on both sides), and starts ``num_workers`` Ray Train workers.
2. The driver reads the token columns with Ray Data (images stay on disk, decoded only for the
   rows a worker trains on) and materializes the train and validation splits in the object
   store, one block per part file in file order. **Data order**: every epoch each worker
   iterates the same dataset through a local shuffle buffer seeded with ``(seed, epoch)``, in
   global micro-batches of ``num_workers x micro_batch`` rows, and keeps its own
   ``micro_batch`` slice. The order depends only on the data and ``(seed, epoch)``, so a
   resumed run reproduces it exactly by skipping the micro-batches already done; reading the
   token ids on every worker is cheap next to the forward pass.
3. Loss: mean negative log-likelihood over the ``gen_mask`` tokens (every assistant turn,
   nothing the template, the user or a tool wrote), normalised by the number of such tokens
   in the whole optimizer step over all workers and accumulation steps, so long and short
   trajectories weigh by their tokens and the result does not depend on how rows fall on
   workers. Images go in as the pixels ``processor_inputs`` rebuilds from the stored PNGs.
4. Every ``ckpt_every`` steps: DeepSpeed state of every rank + a Hugging Face directory
   (``hf/``) into one Ray Train checkpoint, the last ``keep`` kept. Rerunning the same command
   resumes from the newest (same run folder, same data order); a worker that dies is replaced
   and the group restarts from it (``max_failures``).
5. At the end the driver copies ``hf/`` of the last checkpoint to ``<run_dir>/model`` and
   measures the share of greedy first turns on held-out questions that parse, before and after.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from osvl.config import RunConfig, opt
from osvl.errors import ConfigError, DataError
from osvl.logs import Progress

logger = logging.getLogger(__name__)

JOB = "sft"
CURVES = "curves.png"  # the training curves, redrawn at each checkpoint and at the end (osvl/plots.py)
CURVE_PANELS = [("loss (token-mean NLL)", ["loss", "val_loss"]), ("learning rate", ["lr"]),
                ("gradient norm", ["grad_norm"])]
COLUMNS = ["id", "question_id", "input_ids", "gen_mask", "step_ids", "images", "image_max_pixels"]


@dataclasses.dataclass
class DataConfig:
    trajectories: str = opt("", "Trajectory folder (write_trajectories output) or its trajectories.parquet; "
                                "empty = run (or reuse) jobs/trajectories.py with its demo profile.")
    sharegpt: str = opt("", "Train on an OpenSearch-VL ShareGPT release file instead (JSON/JSONL; images "
                            "relative to it), imported once with the student's tokenizer and processor.")
    val_fraction: float = opt(0.05, "Share of questions held out for the validation loss (by question-id hash).")
    heldout: str = opt("", "Synthesized heldout.parquet whose questions the format check uses; empty = the one "
                           "next to the trajectories' synthesized questions, skipped when none is found.")
    n_eval: int = opt(100, "Held-out questions for the greedy first-turn format check (0 skips it).")


@dataclasses.dataclass
class SftConfig:
    run: RunConfig = opt(RunConfig, "Run root and seed.")
    data: DataConfig = opt(DataConfig, "Training data.")
    model: str = opt("", "Checkpoint directory to fine-tune; empty = the tiny model of tiny_kind.")
    tiny_kind: str = opt("qwen3_vl", "osvl.models.tiny kind used when model is empty.")
    epochs: float = opt(1.0, "Passes over the training trajectories (fractions allowed).")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = epochs decide).")
    micro_batch: int = opt(4, "Trajectories per worker per forward.")
    grad_accum: int = opt(1, "Micro-batches accumulated per optimizer step.")
    max_len: int = opt(2048, "Tokens per trajectory fed to the model.")
    truncation: Literal["cut", "drop"] = opt("cut", "Longer trajectories: cut (before any image the cut would "
                                                    "split) or drop; counted in the metrics either way.")
    lr: float = opt(1e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = opt(0.1, "Cosine decay floor, as a fraction of lr.")
    warmup: float = opt(0.05, "Linear warm-up, as a fraction of the steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Gradient-norm clipping (DeepSpeed gradient_clipping).")
    grad_checkpointing: bool = opt(False, "Recompute activations in backward (memory for compute).")
    freeze_vision: bool = opt(False, "Train the language model only; the vision tower stays as loaded.")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (2 or 3).")
    bf16: bool | None = opt(None, "bf16 mixed precision; None = on with GPUs, off (fp32) on CPU.")
    shuffle_buffer: int = opt(256, "Rows in the seeded local shuffle buffer.")
    num_workers: int = opt(2, "Ray Train workers (data parallel).", hashed=False)
    threads_per_worker: int = opt(1, "CPUs each worker reserves and torch threads it uses.", hashed=False)
    use_gpu: bool = opt(False, "One GPU per worker, NCCL.", hashed=False)
    ckpt_every: int = opt(50, "Checkpoint every N optimizer steps (and at the end).")
    keep: int = opt(2, "Checkpoints kept (the newest).", hashed=False)
    val_every: int = opt(50, "Validation loss every N steps (and at the end; 0 = only at the end).")
    log_every: int = opt(5, "Progress line every N steps.", hashed=False)
    max_failures: int = opt(2, "Worker-group failures recovered from (restart at the last checkpoint).",
                            hashed=False)


# ---------------------------------------------------------------------------
# data


def parquet_files(path: str | Path) -> tuple[list[Path], Path]:
    """(part files, image folder) of a trajectory folder or its ``trajectories.parquet``."""
    p = Path(path)
    if (p / "trajectories.parquet").exists():
        p = p / "trajectories.parquet"
    files = sorted(p.glob("part-*.parquet")) if p.is_dir() else [p]
    files = [f for f in files if f.is_file() and f.stat().st_size > 0]
    if not files:
        raise DataError(f"no trajectory parquet at {path}")
    return files, p.parent / "images"


def is_val(question_id: str, fraction: float) -> bool:
    """Deterministic question-level split (crc32 of the id), so trajectories of one question stay together."""
    return zlib.crc32(question_id.encode()) % 10_000 < fraction * 10_000


def count_rows(files: list[Path], val_fraction: float) -> tuple[int, int]:
    """(train rows, validation rows), from the question-id column only."""
    import pyarrow.parquet as pq

    n_train = n_val = 0
    for f in files:
        for qid in pq.read_table(f, columns=["question_id"]).column(0).to_pylist():
            if is_val(qid, val_fraction):
                n_val += 1
            else:
                n_train += 1
    return n_train, n_val


def load_split(files: list[Path], val_fraction: float, val: bool):
    """The train or validation rows (token columns only) as a Ray Dataset materialized in the object store.

    Read and filtered once, in file order (``preserve_order``), into one block per file, so
    the block layout, and with it every epoch's order, is the same in a resumed run.
    """
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # the job prints its own progress line
    from osvl import storage

    # read tasks run on any node: files in a mirror are read from the storage it mirrors
    where = [storage.location(f) for f in files]
    fs = storage.open_root(where[0])[0] if storage.is_remote(where[0]) else None
    paths = [storage.open_root(w)[1] for w in where] if fs is not None else [str(f) for f in files]
    ds = ray.data.read_parquet(paths, filesystem=fs, columns=COLUMNS, override_num_blocks=len(files))
    return ds.filter(lambda r: is_val(r["question_id"], val_fraction) == val).materialize()


def global_batches(ds, *, rows: int, drop_last: bool, shuffle_buffer: int = 0, seed: int = 0):
    """Yield lists of ``rows`` records of ``ds``, shuffled by a buffer seeded with ``seed`` (0 rows: in order)."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    kw: dict[str, Any] = {}
    if shuffle_buffer > 1:
        kw = {"local_shuffle_buffer_size": shuffle_buffer, "local_shuffle_seed": seed}
    for batch in ds.iter_batches(batch_size=rows, batch_format="pyarrow", drop_last=drop_last, **kw):
        yield [SimpleNamespace(logprobs=[], **r) for r in batch.to_pylist()]


# ---------------------------------------------------------------------------
# the worker loop


def lr_lambda(total: int, warmup: float, floor: float):
    """Linear warm-up then cosine decay to ``floor`` (fractions of the peak), indexed by optimizer step."""
    warm = max(1, round(total * warmup))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def build_model(cfg: SftConfig, model_dir: str, dtype: str):
    """The model to train, with gradient checkpointing and the frozen vision tower as configured."""
    from osvl.models.load import load_model

    model = load_model(model_dir, dtype=dtype)
    model.config.use_cache = False
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.freeze_vision:
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    model.train()
    return model


def _forward_nll(engine, rows, image_dir, processor, cfg: SftConfig):
    """(NLL sum over gen tokens, gen tokens, tokens, truncated rows, dropped rows) of one micro-batch."""
    from osvl.train.batch import collate, ensure_image, masked_nll, token_logprobs

    batch = collate(rows, image_dir, processor, cfg.max_len, cfg.truncation)
    if batch["input_ids"].shape[0] == 0:
        raise DataError(f"every trajectory of a micro-batch was dropped (max_len={cfg.max_len}); raise max_len")
    batch = ensure_image(batch, processor)  # same graph on every rank: ZeRO's reduce order depends on it
    nll, n_gen = masked_nll(token_logprobs(engine, batch), batch["gen_mask"])
    return nll, n_gen, int(batch["attention_mask"].sum()), int(batch["truncated"].sum()), int(batch["n_dropped"])


def _gen_tokens(rows, max_len: int) -> int:
    """Gen-mask tokens of ``rows`` within ``max_len`` (an upper bound when a cut moves before an image)."""
    return sum(sum(r.gen_mask[:max_len]) for r in rows)


def validate(engine, ds, image_dir, processor, cfg: SftConfig, rank: int, world: int) -> float:
    """Token-mean NLL over the validation questions; every rank runs the same number of forwards (ZeRO-3)."""
    import torch
    import torch.distributed as dist

    engine.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for rows in global_batches(ds, rows=world * cfg.micro_batch, drop_last=False):
            mine = rows[rank * cfg.micro_batch:(rank + 1) * cfg.micro_batch]
            weight = 1.0 if mine else 0.0  # a short last batch: forward a stand-in row, count nothing
            nll, n_gen, *_ = _forward_nll(engine, mine or rows[:1], image_dir, processor, cfg)
            tot += torch.tensor([float(nll) * weight, float(n_gen) * weight], dtype=torch.float64)
    engine.train()
    dist.all_reduce(tot)
    return float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")


def train_loop(config: dict) -> None:
    """One Ray Train worker: DeepSpeed engine, deterministic data stream, checkpoints, metrics."""
    import ray.train
    import torch
    import torch.distributed as dist

    from osvl.logs import setup
    from osvl.metrics import TRAIN_GRAD_NORM, TRAIN_LOSS, TRAIN_LR, TRAIN_TOKENS_PER_S, TRAIN_VAL_LOSS, Recorder
    from osvl.models.load import load_processor
    from osvl.train.deepspeed import ds_config, init_engine, load_checkpoint, save_checkpoint

    setup()  # a Ray Train worker: its root logger is not configured yet
    cfg: SftConfig = config["cfg"]
    from osvl import storage

    # a location (osvl.storage): this node may hold no copy of the images yet
    train_ds, val_ds, image_dir = config["train_ds"], config["val_ds"], storage.attach(config["image_dir"])
    total, val_rows, log_file = config["total_steps"], config["val_rows"], Path(config["log_file"])
    torch.set_num_threads(cfg.threads_per_worker)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    bf16 = cfg.bf16 if cfg.bf16 is not None else cfg.use_gpu
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, config["model_dir"], "float32")
    processor = load_processor(config["model_dir"])
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(total, cfg.warmup, cfg.min_lr_ratio))
    engine = init_engine(model, optim, sched, ds_config(
        cfg.zero_stage, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, world_size=world,
        grad_clip=cfg.grad_clip, bf16=bf16))

    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            step = int(load_checkpoint(engine, Path(d))["step"])
        if rank == 0:
            logger.info(f"sft: resumed at step {step}/{total}")
            with log_file.open("a") as f:
                f.write(json.dumps({"resumed_at": step}) + "\n")
    rec = Recorder(JOB, log_file.parent.name)  # run label: the run folder (config hash or run.name)
    # a Ray Train worker's output is never a terminal: plain lines in the job log, from rank 0 only
    bar = Progress(total, "sft", "steps", initial=step)
    rows_per_micro = world * cfg.micro_batch
    micro_per_epoch = config["train_rows"] // rows_per_micro
    t_start = t_last = t_step = time.time()
    tok_since = 0
    val_loss = float("nan")

    def finish_step(loss: float, grad_norm: float, tokens: int, cut: int, dropped: int) -> None:
        nonlocal t_last, t_step, tok_since, val_loss
        tok_since += tokens
        step_s = time.time() - t_step  # forward/backward/step only: validation and checkpoints come after
        is_last = step == total
        if cfg.val_every and step % cfg.val_every == 0 or is_last:
            val_loss = validate(engine, val_ds, image_dir, processor, cfg, rank, world) if val_rows else val_loss
        lr = sched.get_last_lr()[0]
        log = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "step_s": step_s,
               "truncated": cut, "dropped": dropped}
        if not math.isnan(val_loss):
            log["val_loss"] = val_loss
        if rank == 0:
            bar.update(1, loss=loss)
            with log_file.open("a") as f:
                f.write(json.dumps(log) + "\n")
            rec.set(TRAIN_LOSS, loss)
            rec.set(TRAIN_LR, lr)
            rec.set(TRAIN_GRAD_NORM, grad_norm)
            if not math.isnan(val_loss):
                rec.set(TRAIN_VAL_LOSS, val_loss)
        if step % cfg.log_every == 0 or is_last:
            now = time.time()
            tps = tok_since / max(now - t_last, 1e-9)
            t_last, tok_since = now, 0
            if rank == 0:
                rec.set(TRAIN_TOKENS_PER_S, tps)
                el = now - t_start
                val = f" | val {val_loss:.4f}" if not math.isnan(val_loss) else ""
                logger.info(f"sft step {step}/{total} | loss {loss:.4f}{val} | lr {lr:.2e} | gnorm {grad_norm:.3f} | "
                            f"{tps:,.0f} tok/s | {el:.0f}s")
        if step % cfg.ckpt_every == 0 or is_last:
            with tempfile.TemporaryDirectory(prefix="osvl-sft-") as d:
                save_checkpoint(engine, Path(d), {"step": step}, processor if rank == 0 else None)
                ray.train.report(log, checkpoint=ray.train.Checkpoint.from_directory(d))
            if rank == 0:
                logger.info(f"sft: checkpoint step {step}")
                draw_curves(log_file)
        t_step = time.time()

    micro_done = step * cfg.grad_accum  # global micro-batches consumed before this run
    epoch = micro_done // max(1, micro_per_epoch)
    while step < total:
        skip = micro_done - epoch * micro_per_epoch
        stream = global_batches(train_ds, rows=rows_per_micro, drop_last=True, shuffle_buffer=cfg.shuffle_buffer,
                                seed=cfg.run.seed * 1_000 + epoch)
        pending: list[list] = []
        for i, rows in enumerate(stream):
            if i < skip:
                continue
            pending.append(rows)
            if len(pending) < cfg.grad_accum:
                continue
            # the step's gen-token count over all workers and micro-batches: every worker sees every row
            denom = float(sum(_gen_tokens(r, cfg.max_len) for r in pending))
            stats = torch.zeros(5, dtype=torch.float64)  # nll, gen tokens, tokens, truncated, dropped
            for rows_ in pending:
                mine = rows_[rank * cfg.micro_batch:(rank + 1) * cfg.micro_batch]
                nll, n_gen, n_tok, cut, dropped = _forward_nll(engine, mine, image_dir, processor, cfg)
                # DeepSpeed divides by grad_accum and averages over workers; undo both so the gradient is
                # d(sum of NLL over the step) / (gen tokens of the step)
                engine.backward(nll * (world * cfg.grad_accum / max(denom, 1.0)))
                engine.step()
                stats += torch.tensor([nll.item(), float(n_gen), n_tok, cut, dropped], dtype=torch.float64)
            pending = []
            micro_done += cfg.grad_accum
            step += 1
            dist.all_reduce(stats)
            gn = engine.get_global_grad_norm()
            finish_step(float(stats[0] / max(stats[1], 1.0)), float(gn if gn is not None else float("nan")),
                        int(stats[2]), int(stats[3]), int(stats[4]))
            if step >= total:
                break
        epoch += 1
        if micro_per_epoch == 0:
            raise DataError(f"{config['train_rows']} training rows make no global micro-batch of {rows_per_micro}")


# ---------------------------------------------------------------------------
# the driver


def resolve_data(cfg: SftConfig, out: Path, model_dir: str) -> Path:
    """The trajectory folder to train on (running the demo trajectories job when none is given)."""
    from osvl.config import REPO_ROOT

    if cfg.data.sharegpt:
        from osvl.agent.release import import_sharegpt
        from osvl.agent.trajectory import write_trajectories
        from osvl.models.load import load_processor

        folder = out / "imported"
        if not (folder / "trajectories.parquet").exists():
            trajs, images = import_sharegpt(cfg.data.sharegpt, load_processor(model_dir))
            write_trajectories(folder, trajs, images)
        return folder
    if cfg.data.trajectories:
        p = Path(cfg.data.trajectories)
        return p if p.is_absolute() else REPO_ROOT / p
    from osvl.agent.expert import JOB as TRAJ_JOB
    from osvl.agent.expert import TrajConfig
    from osvl.agent.expert import run as make_trajectories
    from osvl.config import upstream_config

    folder, _ = make_trajectories(upstream_config(TrajConfig, TRAJ_JOB, cfg.run))
    return Path(folder)


def total_steps(cfg: SftConfig, train_rows: int) -> int:
    per_epoch = train_rows // (cfg.num_workers * cfg.micro_batch * cfg.grad_accum)
    if per_epoch == 0:
        raise DataError(f"{train_rows} training trajectories make no optimizer step of "
                        f"{cfg.num_workers}x{cfg.micro_batch}x{cfg.grad_accum} rows")
    steps = max(1, int(per_epoch * cfg.epochs))
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def loss_curve(log_file: Path, width: int = 60) -> str:
    """A few lines that show the loss curve in a terminal: sampled steps and a sparkline."""
    rows = [json.loads(x) for x in log_file.read_text().splitlines() if x.strip()]
    if not rows:
        return "(no steps logged)"
    bars = "▁▂▃▄▅▆▇█"
    losses = [r["loss"] for r in rows]
    idx = sorted({round(i * (len(rows) - 1) / max(1, min(width, len(rows)) - 1)) for i in range(min(width,
                                                                                                     len(rows)))})
    lo, hi = min(losses), max(losses)
    spark = "".join(bars[int((losses[i] - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for i in idx)
    points = [rows[i] for i in sorted({round(k * (len(rows) - 1) / 8) for k in range(9)})]
    table = "  ".join(f"{r['step']}:{r['loss']:.3f}" for r in points)
    return f"loss {hi:.3f} -> {losses[-1]:.3f}  {spark}\n  step:loss  {table}"


def draw_curves(log_file: Path) -> None:
    """``curves.png`` beside the step log, published when the run folder mirrors remote storage."""
    from osvl import storage
    from osvl.plots import training_curves

    training_curves(log_file, CURVE_PANELS, log_file.parent / CURVES, title=f"SFT {log_file.parent.name}")
    storage.publish(log_file.parent, CURVES)


def run(cfg: SftConfig, *, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Train (resuming if this run folder has checkpoints), export the HF model, run the format check."""
    from osvl.cluster import init_ray
    from osvl.config import run_dir, to_dict
    from osvl.models.tiny import tiny_checkpoint
    from osvl.storage import location as storage_location
    from osvl.storage import publish
    from osvl.train.deepspeed import HF_SUBDIR, make_trainer

    if cfg.zero_stage not in (2, 3):
        raise ConfigError(f"zero_stage must be 2 or 3, got {cfg.zero_stage}")
    out = run_dir(cfg, JOB)
    model_dir = cfg.model or str(tiny_checkpoint(cfg.tiny_kind))
    data_dir = resolve_data(cfg, out, model_dir)
    files, image_dir = parquet_files(data_dir)
    n_train, n_val = count_rows(files, cfg.data.val_fraction)
    steps = total_steps(cfg, n_train)
    log(f"sft: {n_train} train / {n_val} validation trajectories from {data_dir}; {steps} steps of "
        f"{cfg.num_workers}x{cfg.micro_batch}x{cfg.grad_accum}, ZeRO-{cfg.zero_stage} -> {out}")
    init_ray(num_cpus=cfg.num_workers * cfg.threads_per_worker + 2)  # +2: Ray Data reads beside the workers
    log_file = out / "train_log.jsonl"
    trainer = make_trainer(
        train_loop, {"cfg": cfg, "train_ds": load_split(files, cfg.data.val_fraction, False),
                     "val_ds": load_split(files, cfg.data.val_fraction, True),
                     "image_dir": storage_location(image_dir),
                     "model_dir": model_dir, "total_steps": steps, "train_rows": n_train, "val_rows": n_val,
                     "log_file": str(log_file)},
        num_workers=cfg.num_workers, threads_per_worker=cfg.threads_per_worker, use_gpu=cfg.use_gpu,
        storage=out, name="train", keep=cfg.keep, max_failures=cfg.max_failures)
    t0 = time.time()
    result = trainer.fit()
    train_s = time.time() - t0
    if result.checkpoint is None:
        raise DataError(f"SFT under {out} produced no checkpoint")
    model_out = out / "model"
    with result.checkpoint.as_directory() as d:
        shutil.rmtree(model_out, ignore_errors=True)
        shutil.copytree(Path(d) / HF_SUBDIR, model_out)
    # the log is appended across resumes (a step after the last checkpoint runs twice): keep each step's
    # last line, and the resume events
    entries = [json.loads(x) for x in log_file.read_text().splitlines() if x.strip()]
    lines = {e["step"]: e for e in entries if "step" in e}
    resumed = [e["resumed_at"] for e in entries if "resumed_at" in e]
    log_file.write_text("".join(json.dumps(lines[k]) + "\n" for k in sorted(lines)))
    log(loss_curve(log_file))
    draw_curves(log_file)
    from osvl.agent.evaluate import OFFER_FILE, trained_tools

    offer = trained_tools(data_dir)  # the policy's prompt showed these tools: evals offer the same
    (model_out / OFFER_FILE).write_text(json.dumps(offer))
    report: dict[str, Any] = {"model": str(model_out), "steps": steps, "train_s": round(train_s, 1),
                              "train_rows": n_train, "val_rows": n_val, "resumed_at": resumed,
                              "final": lines[max(lines)], "config": to_dict(cfg)}
    if cfg.data.n_eval > 0:
        from osvl.train.format_check import format_check, heldout_path

        held = heldout_path(cfg.data.heldout, data_dir)
        if held is None:
            log("sft: no heldout.parquet found; format check skipped")
        else:
            before = format_check(model_dir, held, cfg.data.n_eval, offer)
            after = format_check(str(model_out), held, cfg.data.n_eval, offer)
            report["format_valid_before"], report["format_valid_after"] = before, after
            log(f"sft: greedy first turns that parse on {cfg.data.n_eval} held-out questions: "
                f"{before:.0%} before -> {after:.0%} after")
    (out / "report.json").write_text(json.dumps(report, indent=1))
    publish(out)  # the report last: it says the model is complete
    return report
