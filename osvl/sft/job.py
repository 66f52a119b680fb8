"""Supervised fine-tuning on trajectory records: Ray Train workers, DeepSpeed ZeRO, Ray Data input.

What one run does (``jobs/sft.py`` parses the config and calls ``run``):

1. The driver finds the trajectory table (a ``write_trajectories`` folder; a ShareGPT release
   file is first imported into one), splits questions into train and validation by a hash of
   the question id (no question is on both sides), and starts ``workers`` Ray Train workers.
2. The driver reads the token columns (images stay on disk, decoded only for the rows a worker
   trains on) and puts the train and validation splits in the object store as Ray Datasets,
   one block per part file in file order. **Data order**: every epoch each worker
   iterates the same dataset through a local shuffle buffer seeded with ``(seed, epoch)``, in
   global micro-batches of ``workers x micro_batch`` rows, and keeps its own
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
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

from osvl.agent.evaluate import OFFER_FILE, trained_tools
from osvl.agent.release import import_sharegpt
from osvl.agent.trajectory import write_trajectories
from osvl.cluster import init_ray
from osvl.config import REPO_ROOT, RunConfig, input_path, opt, run_dir, to_dict
from osvl.errors import ConfigError, DataError
from osvl.models.tiny import TinyKind, checkpoint_name, tiny_checkpoint
from osvl.sft.data import check_tokenizer, count_rows, load_split, long_rows, parquet_files
from osvl.sft.format_check import format_check, heldout_path
from osvl.sft.loop import draw_curves, train_loop
from osvl.storage import location as storage_location
from osvl.storage import publish
from osvl.tracking import tracked
from osvl.train.deepspeed import HF_SUBDIR, make_trainer
from osvl.train.rehearsal import Rehearsal

logger = logging.getLogger(__name__)

JOB = "sft"


@dataclasses.dataclass
class DataConfig:
    trajectories: str = opt("", "Trajectory folder (write_trajectories output) or its trajectories.parquet; "
                                "empty = jobs/sft.py runs (or reuses) jobs/trajectories.py with its demo profile.")
    sharegpt: str = opt("", "Train on an OpenSearch-VL ShareGPT release file instead (JSON/JSONL; images "
                            "relative to it), imported once with the student's tokenizer and processor.")
    val_fraction: float = opt(0.05, "Share of questions held out for the validation loss (by question-id hash).")
    heldout: str = opt("", "Synthesized heldout.parquet whose questions the format check uses; empty = the one "
                           "next to the trajectories' synthesized questions, skipped when none is found.")
    n_eval: int = opt(100, "Held-out questions for the greedy first-turn format check (0 skips it).")


@dataclasses.dataclass
class SftConfig:
    RENAMED: ClassVar[dict[str, str]] = {"num_workers": "workers", "warmup": "warmup_share"}

    run: RunConfig = opt(RunConfig, "Run root and seed.")
    data: DataConfig = opt(DataConfig, "Training data.")
    model: str = opt("", "Checkpoint directory to fine-tune (a relative path is taken from the repo root, as "
                         "osvl/models/weights/tiny_policy); empty = the tiny model of tiny_kind.")
    tiny_kind: TinyKind = opt("qwen3_vl", "osvl.models.tiny kind used when model is empty (the run hash sees its "
                                      "checkpoint's name, which changes with its weights).", hash_as=checkpoint_name)
    epochs: float = opt(1.0, "Passes over the training trajectories (fractions allowed).")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = epochs decide).")
    micro_batch: int = opt(4, "Trajectories per worker per forward.")
    grad_accum: int = opt(1, "Micro-batches accumulated per optimizer step.")
    max_len: int = opt(2048, "Tokens per trajectory fed to the model.")
    truncation: Literal["cut", "drop"] = opt("cut", "Longer trajectories: cut (before any image the cut would "
                                                    "split) or drop; counted in the metrics either way.")
    lr: float = opt(1e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = opt(0.1, "Cosine decay floor, as a fraction of lr.")
    warmup_share: float = opt(0.05, "Linear warm-up, as a share of the steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Gradient-norm clipping (DeepSpeed gradient_clipping).")
    grad_checkpointing: bool = opt(False, "Recompute activations in backward (memory for compute).")
    freeze_vision: bool = opt(False, "Train the language model only; the vision tower stays as loaded.")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (2 or 3).")
    bf16: bool | None = opt(None, "bf16 mixed precision; None = on with GPUs, off (fp32) on CPU.")
    shuffle_buffer: int = opt(256, "Rows in the seeded local shuffle buffer.")
    workers: int = opt(2, "Ray Train workers (data parallel).", hashed=False)
    threads_per_worker: int = opt(1, "CPUs each worker reserves and torch threads it uses.", hashed=False)
    use_gpu: bool = opt(False, "One GPU per worker, NCCL.", hashed=False)
    rehearsal: Rehearsal = opt("off", "Run under the GPU rehearsal on CPU (osvl/train/rehearsal.py): every model "
                                      "input and every collective of osvl code must have gone through the "
                                      "placement helpers; each rank's peak host memory is recorded.", hashed=False)
    ckpt_every: int = opt(50, "Checkpoint every N optimizer steps (and at the end).")
    keep: int = opt(2, "Checkpoints kept (the newest).", hashed=False)
    val_every: int = opt(50, "Validation loss every N steps (and at the end; 0 = only at the end).")
    log_every: int = opt(5, "Progress line every N steps.", hashed=False)
    max_failures: int = opt(2, "Worker-group failures recovered from (restart at the last checkpoint).",
                            hashed=False)


# ---------------------------------------------------------------------------
# the driver


def student(cfg: SftConfig) -> dict[str, str]:
    """The trajectories-job overrides that render its records with this run's tokenizer: the records' token
    ids are what SFT trains on, and another tokenizer's ids are other words (``check_tokenizer``)."""
    # as written, not resolved: a checkout's absolute path in the trajectories run's hash would make
    # every clone (and every `ray job submit --working-dir`, unpacked elsewhere) rebuild the records and SFT
    return {"model": cfg.model} if cfg.model else {"tiny_kind": cfg.tiny_kind}


def resolve_data(cfg: SftConfig, out: Path, model_dir: str, trajectories: Path | None) -> Path:
    """The trajectory folder to train on: ``data.sharegpt`` imported, ``data.trajectories``, else ``trajectories``
    (the recipe's: ``osvl.recipe.run_sft`` builds or reuses the demo records)."""
    if cfg.data.sharegpt:
        from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

        folder = out / "imported"
        if not (folder / "trajectories.parquet").exists():
            trajs, images = import_sharegpt(cfg.data.sharegpt, load_processor(model_dir))
            write_trajectories(folder, trajs, images)
        return folder
    if cfg.data.trajectories:
        p = Path(cfg.data.trajectories)
        return p if p.is_absolute() else REPO_ROOT / p
    if trajectories is None:
        raise ConfigError("data.trajectories and data.sharegpt are empty: name the records to train on "
                          "(jobs/sft.py builds the demo ones: osvl.recipe.run_sft)")
    return trajectories


def total_steps(cfg: SftConfig, train_rows: int) -> int:
    per_epoch = train_rows // (cfg.workers * cfg.micro_batch * cfg.grad_accum)
    if per_epoch == 0:
        raise DataError(f"{train_rows} training trajectories make no optimizer step of "
                        f"{cfg.workers}x{cfg.micro_batch}x{cfg.grad_accum} rows")
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


@tracked(JOB)
def run(cfg: SftConfig, *, log: Callable[[str], None] = logger.info,
        trajectories: Path | None = None) -> dict[str, Any]:
    """Train on ``data.trajectories`` (else ``trajectories``, given apart so that the run's hash is the config's
    as written), resuming if this run folder has checkpoints; export the HF model, run the format check."""
    if cfg.zero_stage not in (2, 3):
        raise ConfigError(f"zero_stage must be 2 or 3, got {cfg.zero_stage}")
    out = run_dir(cfg, JOB)
    model_dir = str(input_path(cfg.model)) if cfg.model else str(tiny_checkpoint(cfg.tiny_kind))
    data_dir = resolve_data(cfg, out, model_dir, trajectories)
    files, image_dir = parquet_files(data_dir)
    check_tokenizer(files[0], model_dir)
    n_train, n_val = count_rows(files, cfg.data.val_fraction)
    steps = total_steps(cfg, n_train)
    log(f"sft: {n_train} train / {n_val} validation trajectories from {data_dir}; {steps} steps of "
        f"{cfg.workers}x{cfg.micro_batch}x{cfg.grad_accum}, ZeRO-{cfg.zero_stage} -> {out}")
    n_long, n_rows, longest = long_rows(files, cfg.max_len)
    if n_long:
        fate = "cut: their last turns, the answer among them, are not trained" if cfg.truncation == "cut" \
            else "dropped"
        log(f"sft: WARNING {n_long} of {n_rows} trajectories are longer than max_len={cfg.max_len} "
            f"(longest {longest} tokens) and are {fate}")
    init_ray(num_cpus=cfg.workers * cfg.threads_per_worker + 2)  # +2: Ray Data reads beside the workers
    log_file = out / "train_log.jsonl"
    trainer = make_trainer(
        train_loop, {"cfg": cfg, "train_ds": load_split(files, cfg.data.val_fraction, False),
                     "val_ds": load_split(files, cfg.data.val_fraction, True) if n_val else None,
                     "image_dir": storage_location(image_dir),
                     "model_dir": model_dir, "total_steps": steps, "train_rows": n_train, "val_rows": n_val,
                     "log_file": str(log_file), "job": JOB},
        num_workers=cfg.workers, threads_per_worker=cfg.threads_per_worker, use_gpu=cfg.use_gpu,
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

    offer = trained_tools(data_dir)  # the policy's prompt showed these tools: evals offer the same
    (model_out / OFFER_FILE).write_text(json.dumps(offer))
    report: dict[str, Any] = {"model": str(model_out), "steps": steps, "train_s": round(train_s, 1),
                              "train_rows": n_train, "val_rows": n_val, "rows_over_max_len": n_long,
                              "resumed_at": resumed,
                              "final": lines[max(lines)], "config": to_dict(cfg)}
    if cfg.data.n_eval > 0:
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
