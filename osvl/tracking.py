"""Experiment tracking: every training and eval job's scalars as TensorBoard event files, and an index of runs.

Why TensorBoard by default: its event files are plain local files (``<run folder>/tb/``), written offline,
published with the rest of a run folder when the run root is remote, and read by ``tensorboard --logdir
<run root>`` across every job at once. W&B and MLflow are opt-in (``run.tracking``): they need a package
this project does not install and, online, an account, so a run never depends on them unless asked;
they are imported only when selected, and a missing one is a ``ConfigError`` naming the package.

A ``Tracker`` lives in the one process that already writes a job's per-step file (the GRPO learner's rank 0
writes ``steps.jsonl``, the SFT worker of rank 0 ``train_log.jsonl``, the eval driver its summary), so a
run's scalars are logged once, not once per rank. ``Tracker.disabled()`` is a no-op stand-in for the other
ranks: callers log unconditionally.

``tracked(job)`` wraps a job's library entry (``run(cfg, ...)``): at start it points ``<root>/<job>/latest``
at the run folder and appends a "started" line to ``<root>/runs.jsonl``; at the end a "finished" or
"failed" line. Both are skipped for a remote root (``s3://``, ``gs://``): an object store has no symlinks
and no atomic append, and each job's folder is already found by its config hash.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import importlib.util
import json
import logging
import math
import numbers
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from osvl import storage
from osvl.config import config_hash
from osvl.errors import ConfigError

TB_DIR = "tb"  # under a run folder: TensorBoard's event files
INDEX = "runs.jsonl"  # under the run root: one line per job start and end
LATEST = "latest"  # under <root>/<job>/: a relative symlink to the newest run folder
DEFAULT_PROJECT = "osvl"
SKIP = ("step", "time")  # a row's x axis and its wall time: TensorBoard records both itself
PACKAGES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
"""backend -> (the package to install, the module the tracker imports)."""
log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def check(backends: Sequence[str]) -> None:
    """Fail with a ``ConfigError`` naming the package when a selected backend is not installed; imports nothing
    (``find_spec``), so a job checks at start, before any cluster, what its Ray workers will import later."""
    for backend in backends:
        if backend not in PACKAGES:
            raise ConfigError(f"run.tracking: unknown backend {backend!r}; one of {', '.join(PACKAGES)}")
        package = PACKAGES[backend][0]
        if importlib.util.find_spec(package) is None:
            raise _missing(backend)


def _missing(backend: str, why: object = "") -> ConfigError:
    package = PACKAGES[backend][0]
    return ConfigError(f"run.tracking lists {backend!r} but the {package} package is not installed"
                       f"{f' ({why})' if why else ''}: pip install {package}, or leave {backend} out of run.tracking")


def _import(backend: str) -> Any:
    try:
        return importlib.import_module(PACKAGES[backend][1])
    except ImportError as e:
        raise _missing(backend, e) from None


def scalars(values: Mapping[str, Any], skip: Sequence[str] = SKIP, prefix: str = "") -> dict[str, float]:
    """Every numeric field of a row as ``{name: float}``: bools as 0/1, nested mappings flattened as
    ``outer/inner``; strings, lists, None and the ``skip`` keys (top level only) left out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if not prefix and key in skip:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, (), prefix=f"{name}/"))
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
    return out


class Tracker:
    """Scalars of one run, to every backend selected; ``with Tracker.for_run(...) as t: t.log(row, step)``.

    A tracker without a run folder or without backends is disabled: every method does nothing, so the ranks
    that do not log hold one too and need no ``if rank == 0`` around each call.
    """

    def __init__(self, run_dir: str | Path | None, backends: Sequence[str] = ("tensorboard",), *, project: str = "",
                 name: str = "", config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.backends = tuple(dict.fromkeys(backends)) if self.run_dir is not None else ()
        check(self.backends)  # every backend checked before any opens: a missing one leaves no files behind
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: tuple[Any, str] | None = None  # (client, run id)
        name = name or (self.run_dir.name if self.run_dir is not None else "")
        if "tensorboard" in self.backends:
            (self.run_dir / TB_DIR).mkdir(parents=True, exist_ok=True)
            self._tb = _import("tensorboard").SummaryWriter(log_dir=str(self.run_dir / TB_DIR))
        if "wandb" in self.backends:  # WANDB_MODE=offline keeps it on this disk (``wandb sync`` later)
            self._wandb = _import("wandb").init(project=project or DEFAULT_PROJECT, name=name, dir=str(self.run_dir),
                                                config=dict(config or {}))
        if "mlflow" in self.backends:
            mlflow = _import("mlflow")
            # without MLFLOW_TRACKING_URI, a file store beside the run index: a Ray worker's cwd is a temp folder
            root = self.run_dir.resolve().parent.parent
            uri = None if os.environ.get("MLFLOW_TRACKING_URI") else (root / "mlruns").as_uri()
            client = mlflow.MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(project or DEFAULT_PROJECT)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(project or DEFAULT_PROJECT)
            run = client.create_run(exp_id, tags={"mlflow.runName": name})
            self._mlflow = (client, run.info.run_id)

    @classmethod
    def for_run(cls, run_dir: str | Path, run: Any, *, job: str = "", config: Mapping[str, Any] | None = None
                ) -> Tracker:
        """The tracker a job's ``RunConfig`` (``run.tracking``, ``run.tracking_project``) asks for; W&B and MLflow
        name the run ``<job>/<run folder>``."""
        return cls(run_dir, list(getattr(run, "tracking", ["tensorboard"])),
                   project=getattr(run, "tracking_project", ""),
                   name=f"{job}/{Path(run_dir).name}" if job else "", config=config)

    @classmethod
    def disabled(cls) -> Tracker:
        return cls(None, ())

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def log(self, values: Mapping[str, Any], step: int) -> dict[str, float]:
        """Log the numeric fields of ``values`` (``scalars``) at ``step``; returns what was logged. TensorBoard's
        file is flushed at once: a job killed mid-run keeps every step it logged."""
        found = scalars(values) if self.enabled else {}
        if not found:
            return found
        if self._tb is not None:
            for name, value in found.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(found, step=step)
        if self._mlflow is not None:
            client, run_id = self._mlflow
            now = int(time.time() * 1000)
            for name, value in found.items():
                if math.isfinite(value):  # MLflow's stores refuse NaN and infinities
                    client.log_metric(run_id, name, value, timestamp=now, step=step)
        return found

    def publish(self) -> None:
        """Upload the event files when the run folder mirrors remote storage (``osvl.storage.publish``)."""
        if self._tb is not None:
            self._tb.flush()
            storage.publish(self.run_dir, TB_DIR)

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend; idempotent."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None
        if self._mlflow is not None:
            client, run_id = self._mlflow
            client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
            self._mlflow = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """What a run folder's event files hold: ``{name: [(step, value), ...]}`` in step order (for tests and
    reports; ``tensorboard --logdir`` is the viewer)."""
    # lazy: (b) tensorboard is not in the vLLM env
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    acc = EventAccumulator(str(Path(run_dir) / TB_DIR), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---------------------------------------------------------------------------
# the index of runs


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _append(path: Path, record: dict[str, Any]) -> None:
    """One ``write`` of one line with O_APPEND: lines of jobs started side by side do not interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())
    finally:
        os.close(fd)


def point_latest(job_dir: Path, folder: str) -> None:
    """``job_dir/latest`` -> ``folder`` (relative), replaced atomically: a reader sees the old or the new link."""
    tmp = job_dir / f".{LATEST}.{uuid.uuid4().hex}.tmp"
    os.symlink(folder, tmp)
    try:
        os.replace(tmp, job_dir / LATEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def job_run(cfg: Any, job: str) -> Iterator[None]:
    """Around one job: the backends checked, ``latest`` and a "started" line at start; a "finished" or "failed"
    line (with the exception's type) at the end. Index trouble (a read-only root) is logged, never raised."""
    run = cfg.run
    check(getattr(run, "tracking", ()))
    root = str(run.root)
    storage.open_root(root, "run.root")  # a bad root fails here, as in run_dir, before a folder is made for it
    if storage.is_remote(root):
        yield
        return
    digest = config_hash(cfg)
    folder = run.name or digest
    base = Path(root.removeprefix("file://"))
    entry = {"run_id": uuid.uuid4().hex[:12], "job": job, "folder": folder, "config_hash": digest}
    try:
        (base / job).mkdir(parents=True, exist_ok=True)
        if folder != LATEST:  # a run named "latest" keeps its folder; the link is left as it was
            point_latest(base / job, folder)
        _append(base / INDEX, {**entry, "argv": list(sys.argv), "start": _now(), "status": "started"})
    except OSError as e:
        log.warning("run index under %s not updated: %s", base, e)
    t0 = time.perf_counter()
    status, error = "failed", ""
    try:
        yield
        status = "finished"
    except SystemExit as e:
        status, error = ("finished", "") if e.code in (0, None) else ("failed", "SystemExit")
        raise
    except BaseException as e:
        error = type(e).__name__
        raise
    finally:
        with contextlib.suppress(OSError):
            _append(base / INDEX, {**entry, "end": _now(), "seconds": round(time.perf_counter() - t0, 1),
                                   "status": status, **({"error": error} if error else {})})


def tracked(job: str) -> Callable[[F], F]:
    """Decorate a job's library entry ``run(cfg, ...)`` with ``job_run(cfg, job)``."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            with job_run(cfg, job):
                return fn(cfg, *args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap
