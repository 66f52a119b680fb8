"""SFT's Ray Train worker: the DeepSpeed engine, the deterministic data stream, checkpoints, metrics.

The loss, the data order and the checkpoints are described in ``osvl/sft/job.py``; the driver
there starts ``train_loop`` on every worker.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from osvl import storage
from osvl.config import to_dict
from osvl.errors import DataError
from osvl.logs import Progress, setup
from osvl.metrics import TRAIN_GRAD_NORM, TRAIN_LOSS, TRAIN_LR, TRAIN_TOKENS_PER_S, TRAIN_VAL_LOSS, Recorder
from osvl.plots import training_curves
from osvl.sft.data import global_batches
from osvl.tracking import Tracker
from osvl.train import device, rehearsal
from osvl.train.batch import collate, ensure_image, masked_nll, token_logprobs
from osvl.train.deepspeed import ds_config, hidden_size, init_engine, load_checkpoint, load_trainable, save_checkpoint

if TYPE_CHECKING:
    from osvl.sft.job import SftConfig

logger = logging.getLogger(__name__)

CURVES = "curves.png"  # the training curves, redrawn at each checkpoint and at the end (osvl/plots.py)
CURVE_PANELS = [("loss (token-mean NLL)", ["loss", "val_loss"]), ("learning rate", ["lr"]),
                ("gradient norm", ["grad_norm"])]


def lr_lambda(total: int, warmup: float, floor: float):
    """Linear warm-up then cosine decay to ``floor`` (fractions of the peak), indexed by optimizer step."""
    warm = max(1, round(total * warmup))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def build_model(cfg: SftConfig, model_dir: str, ds_cfg: dict):
    """The model to train, built as ``ds_cfg`` runs it (bf16 or fp32; partitioned under ZeRO-3), with
    gradient checkpointing and the frozen vision tower as configured."""
    model = load_trainable(model_dir, ds_cfg, grad_checkpointing=cfg.grad_checkpointing)
    if cfg.freeze_vision:
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    model.train()
    return model


def _forward_nll(engine, rows, image_dir, processor, cfg: SftConfig):
    """(NLL sum over gen tokens, gen tokens, tokens, truncated rows, dropped rows) of one micro-batch."""
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
    engine.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for rows in global_batches(ds, rows=world * cfg.micro_batch, drop_last=False):
            mine = rows[rank * cfg.micro_batch:(rank + 1) * cfg.micro_batch]
            weight = 1.0 if mine else 0.0  # a short last batch: forward a stand-in row, count nothing
            nll, n_gen, *_ = _forward_nll(engine, mine or rows[:1], image_dir, processor, cfg)
            tot += torch.tensor([float(nll) * weight, float(n_gen) * weight], dtype=torch.float64)
    engine.train()
    tot = device.all_reduce(tot)
    return float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")


def train_loop(config: dict) -> None:
    """One Ray Train worker: DeepSpeed engine, deterministic data stream, checkpoints, metrics."""
    import ray.train  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    setup()  # a Ray Train worker: its root logger is not configured yet
    cfg: SftConfig = config["cfg"]

    # a location (osvl.storage): this node may hold no copy of the images yet
    train_ds, val_ds, image_dir = config["train_ds"], config["val_ds"], storage.attach(config["image_dir"])
    total, val_rows, log_file = config["total_steps"], config["val_rows"], Path(config["log_file"])
    torch.set_num_threads(cfg.threads_per_worker)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    bf16 = cfg.bf16 if cfg.bf16 is not None else cfg.use_gpu
    rehearsal.install(cfg.rehearsal, log_file.parent, rank)
    torch.manual_seed(cfg.run.seed)
    ds_cfg = ds_config(cfg.zero_stage, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, world_size=world,
                       grad_clip=cfg.grad_clip, bf16=bf16, hidden_size=hidden_size(config["model_dir"]),
                       on_gpu=cfg.use_gpu)
    model = build_model(cfg, config["model_dir"], ds_cfg)
    processor = load_processor(config["model_dir"])
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(total, cfg.warmup_share, cfg.min_lr_ratio))
    engine = init_engine(model, optim, sched, ds_cfg)
    rehearsal.note_peak("load")

    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            step = int(load_checkpoint(engine, Path(d))["step"])
        if rank == 0:
            logger.info(f"sft: resumed at step {step}/{total}")
            with log_file.open("a") as f:
                f.write(json.dumps({"resumed_at": step}) + "\n")
    rec = Recorder(config["job"], log_file.parent.name)  # run label: the run folder (config hash or run.name)
    # TensorBoard (and W&B / MLflow when run.tracking lists them) from rank 0, the writer of train_log.jsonl
    tracker = Tracker.for_run(log_file.parent, cfg.run, job=config["job"], config=to_dict(cfg)) if rank == 0 \
        else Tracker.disabled()
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
            tracker.log(log, step)
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
                tracker.publish()
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
            stats = device.all_reduce(stats)
            rehearsal.note_peak("step1")
            gn = engine.get_global_grad_norm()
            finish_step(float(stats[0] / max(stats[1], 1.0)), float(gn if gn is not None else float("nan")),
                        int(stats[2]), int(stats[3]), int(stats[4]))
            if step >= total:
                break
        epoch += 1
        if micro_per_epoch == 0:
            raise DataError(f"{config['train_rows']} training rows make no global micro-batch of {rows_per_micro}")
    tracker.close()


def draw_curves(log_file: Path) -> None:
    """``curves.png`` beside the step log, published when the run folder mirrors remote storage."""
    training_curves(log_file, CURVE_PANELS, log_file.parent / CURVES, title=f"SFT {log_file.parent.name}")
    storage.publish(log_file.parent, CURVES)
