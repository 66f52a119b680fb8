"""The train_edsr job (``jobs/train_edsr.py``): the default EDSR x4 weights; Ray Train ``TorchTrainer``,
data-parallel, gloo on CPU.

    python jobs/train_edsr.py                        # demo profile: a few steps, proves the loop
    python jobs/train_edsr.py --profile=production   # the committed weights (docs/measurements.md: time)

Why train at all: EDSR weights cannot be downloaded here, so the project makes
its own from real photos (gcompris, OpenCV samples except ``butterfly``,
``skimage.data`` photos) and never from the SR test sets Set5/Set14, which are
only used for the final report. Each worker keeps every photo in memory and
draws random HR patches (flips, 90-degree turns) with its own seed; the LR
input is PIL's antialiased bicubic downscale of the patch, the same degradation
``osvl.tools.super_resolution.make_lr`` applies at test time.

Resumable: checkpoints go to ``<run_dir>/train`` through Ray Train; rerunning the
same config resumes from the latest one (a finished run resumes at its last step
and only re-exports). Output: ``<run_dir>/edsr_x4.pth`` (fp16, basicsr layout +
``osvl`` metadata), and a copy at ``export_to`` when set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import skimage.data

from osvl.cluster import init_ray
from osvl.config import RunConfig, input_path, opt, run_dir
from osvl.errors import ConfigError, DataError
from osvl.logs import setup
from osvl.tools.super_resolution import build_model, evaluate, load_model, make_lr, read_rgb, save_checkpoint
from osvl.tracking import tracked

log = logging.getLogger("train_edsr")

JOB = "train_edsr"
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp")
TEST_SETS = ("Set5", "Set14")


@dataclasses.dataclass
class ModelConfig:
    num_feat: int = opt(32, "EDSR feature channels (basicsr num_feat; the official M model uses 64).")
    num_block: int = opt(8, "EDSR residual blocks (official M: 16).")
    scale: int = opt(4, "Upscaling factor.")
    bicubic_skip: bool = opt(True, "Add a bicubic upsample to the output so the body learns only the residual "
                                   "(not in the official EDSR; stored in the checkpoint metadata).")


@dataclasses.dataclass
class DataConfig:
    photo_dirs: list[str] = opt(["$OSVL_SHARED_DATA/images/gcompris", "$OSVL_SHARED_DATA/images/opencv"],
                                "Folders searched recursively for training photos ($OSVL_SHARED_DATA expanded; "
                                "relative paths are relative to the repo root).")
    exclude: list[str] = opt(["butterfly"], "File stems never used (butterfly is in Set5).")
    skimage: list[str] = opt(["astronaut", "chelsea", "coffee", "rocket"], "skimage.data photos to add.")
    holdout: int = opt(8, "Photos kept out of training for the validation PSNR.")
    min_side: int = opt(128, "Photos whose short side is below this many pixels are skipped.")


@dataclasses.dataclass
class TrainEdsrConfig:
    RENAMED: ClassVar[dict[str, str]] = {"num_workers": "workers"}

    run: RunConfig = opt(RunConfig, "Run root and seed.")
    model: ModelConfig = opt(ModelConfig, "Architecture.")
    data: DataConfig = opt(DataConfig, "Training photos.")
    steps: int = opt(1200, "Optimizer steps.")
    batch_size: int = opt(16, "Patches per worker per step.")
    lr_patch: int = opt(32, "Low-resolution patch side; the HR patch is lr_patch * scale.")
    lr: float = opt(1e-3, "Peak Adam learning rate (cosine decay to 1% after a 2% warm-up).")
    workers: int = opt(2, "Ray Train workers (data-parallel, gloo).", hashed=False)
    threads_per_worker: int = opt(1, "torch threads per worker.", hashed=False)
    ckpt_every: int = opt(100, "Checkpoint (and validate) every N steps.")
    max_failures: int = opt(3, "Worker-group failures Ray Train recovers from (restarting at the last "
                               "checkpoint) before the job fails.", hashed=False)
    eval_dirs: list[str] = opt([], "Test-set folders (e.g. Set5, Set14) evaluated once at the end, never trained "
                                   "on.", hashed=False)
    export_to: str = opt("", "Copy the final weights here too (e.g. osvl/tools/weights/edsr_x4.pth).",
                         hashed=False)


def photo_paths(data: DataConfig) -> list[Path]:
    """Every training photo, sorted by content-independent name hash so the hold-out is a fixed random pick."""
    paths = []
    for d in data.photo_dirs:
        root = input_path(d)
        if not root.is_dir():
            raise DataError(f"photo folder not found: {root}")
        for p in root.rglob("*"):
            if any(part in TEST_SETS for part in p.parts):
                raise ConfigError(f"{p} is in an SR test set; those must never be trained on")
            if p.suffix.lower() in IMAGE_EXTS and p.stem not in data.exclude:
                paths.append(p)
    return sorted(paths, key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())


def load_photos(data: DataConfig) -> tuple[list, list]:
    """(train, holdout) lists of uint8 RGB arrays."""
    imgs = [read_rgb(p) for p in photo_paths(data)]
    if data.skimage:
        imgs += [np.asarray(getattr(skimage.data, n)()) for n in data.skimage]
    imgs = [im for im in imgs if im.ndim == 3 and min(im.shape[:2]) >= data.min_side]
    if len(imgs) <= data.holdout:
        raise DataError(f"only {len(imgs)} usable photos; need more than holdout={data.holdout}")
    return imgs[data.holdout:], imgs[: data.holdout]


def sample_batch(imgs: list, rng, n: int, hr: int, scale: int):
    """``n`` random HR patches with flips/turns and their bicubic LR versions, as float tensors in [0, 1]."""
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/train_edsr.py --help

    his, los = [], []
    for _ in range(n):
        im = imgs[rng.integers(len(imgs))]
        y, x = rng.integers(im.shape[0] - hr + 1), rng.integers(im.shape[1] - hr + 1)
        patch = np.rot90(im[y:y + hr, x:x + hr], k=int(rng.integers(4)))
        if rng.integers(2):
            patch = patch[:, ::-1]
        patch = np.ascontiguousarray(patch)
        his.append(patch)
        los.append(make_lr(patch, scale))

    def t(a):
        return torch.from_numpy(np.stack(a)).permute(0, 3, 1, 2).float().div_(255.0)

    return t(los), t(his)


def train_loop(config: dict) -> None:
    """One Ray Train worker: DDP over gloo, L1 loss, Adam with warm-up + cosine."""
    import ray.train  # noqa: PLC0415 (d) keeps ray out of jobs/train_edsr.py --help
    import ray.train.torch  # noqa: PLC0415 (d) keeps ray out of jobs/train_edsr.py --help
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/train_edsr.py --help

    setup()  # a Ray worker process: its root logger is not configured yet
    cfg: TrainEdsrConfig = config["cfg"]  # the object itself: this script's classes travel by value
    torch.set_num_threads(cfg.threads_per_worker)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(cfg.run.seed)  # identical init on every rank (DDP also broadcasts it)
    m = cfg.model
    net = build_model(m.num_feat, m.num_block, m.scale, m.bicubic_skip)
    model = ray.train.torch.prepare_model(net)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    warm = max(1, cfg.steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warm) * (
        0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location="cpu", weights_only=False)
        net.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
        log.info(f"resumed at step {start}")
    train, holdout = load_photos(cfg.data)
    hold = {f"holdout_{i}": im[:256, :256] for i, im in enumerate(holdout)}
    t0 = time.time()
    for step in range(start, cfg.steps):
        # per-rank, per-step seed: a resumed run draws the same patches it would have drawn
        rng = np.random.default_rng([cfg.run.seed, rank, step])
        lo, hi = sample_batch(train, rng, cfg.batch_size, cfg.lr_patch * m.scale, m.scale)
        loss = (model(lo) - hi).abs().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        done = step + 1
        if done % cfg.ckpt_every and done != cfg.steps:
            continue
        metrics = {"step": done, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                   "sec_per_step": (time.time() - t0) / (done - start)}
        if rank != 0:
            ray.train.report(metrics)
            continue
        net.eval()
        rows = evaluate(net, hold, m.scale)
        net.train()
        metrics["val_psnr_edsr"] = float(np.mean([r["edsr"] for r in rows]))
        metrics["val_psnr_bicubic"] = float(np.mean([r["bicubic"] for r in rows]))
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "step": done}, Path(d) / "state.pt")
            save_checkpoint(net, Path(d) / "edsr.pth", extra={"steps": done, **{k: metrics[k] for k in (
                "val_psnr_edsr", "val_psnr_bicubic")}})
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        log.info(json.dumps(metrics))


@tracked(JOB)
def run(cfg: TrainEdsrConfig) -> dict:
    """The whole job: train (or resume), export the weights, score them on ``eval_dirs``; returns the report."""
    photo_paths(cfg.data)  # fail on bad folders before a cluster starts
    out = run_dir(cfg, JOB)

    import ray.train  # noqa: PLC0415 (d) keeps ray out of jobs/train_edsr.py --help

    # lazy: (d) keeps ray out of jobs/train_edsr.py --help
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415

    init_ray(num_cpus=max(2, cfg.workers * cfg.threads_per_worker))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"cfg": cfg},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.workers, use_gpu=False,
                                               resources_per_worker={"CPU": cfg.threads_per_worker}),
        run_config=ray.train.RunConfig(name="train", storage_path=str(out),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
                                       failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures)),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise DataError(f"training under {out} produced no checkpoint")
    weights = out / "edsr_x4.pth"
    with result.checkpoint.as_directory() as d:
        shutil.copyfile(Path(d) / "edsr.pth", weights)
    model = load_model(weights)
    report = {"weights": str(weights), "bytes": weights.stat().st_size, "meta": model.meta}
    for d in cfg.eval_dirs:
        folder = input_path(d)
        imgs = {p.stem: read_rgb(p) for p in sorted(folder.glob("*.png"))}
        rows = evaluate(model, imgs, cfg.model.scale)
        report[folder.name] = {"per_image": rows,
                               "mean_bicubic": round(sum(r["bicubic"] for r in rows) / len(rows), 3),
                               "mean_edsr": round(sum(r["edsr"] for r in rows) / len(rows), 3)}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if cfg.export_to:
        dst = input_path(cfg.export_to)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights, dst)
        report["exported"] = str(dst)
    return report
