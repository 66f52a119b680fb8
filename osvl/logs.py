"""What a user sees of a long job: log lines in one format, and progress.

Every job's ``main`` starts with ``start_job``, which reads ``--log_level`` (debug, info,
warning, error; default info), configures the root logger once, parses the job's config and
logs it. Library modules log through ``logging.getLogger(__name__)``; nothing prints except
a job's final result (a JSON line or the "demo: OK" verdict), which is output, not a log.

Ray workers are separate processes whose root logger nobody configured (Python then drops
INFO): the worker entry points that log (SFT and learner loops, rollout actors) call
``setup()``, which takes the level the driver chose from ``OSVL_LOG_LEVEL`` (the driver sets
it; ``osvl.cluster.worker_env`` hands it to a cluster osvl starts).

``Progress`` is the one progress display: a tqdm bar when stderr is a terminal, else (a Ray
job log, a pipe, a file) a plain log line at most every ``every_s`` seconds and at the end,
because a bar's carriage returns turn a log file into one unreadable line.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tqdm import tqdm

from osvl.config import dump, normalize_args, parse_args
from osvl.errors import ConfigError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("debug", "info", "warning", "error")
ENV = "OSVL_LOG_LEVEL"
T = TypeVar("T")
log = logging.getLogger(__name__)
QUIET = ("ray", "deepspeed", "httpx", "filelock", "urllib3")
"""Libraries whose INFO lines the handler drops unless --log_level=debug: Ray Train reports every
checkpoint, DeepSpeed every engine setting, httpx every request, and they drown the job's own lines."""


class _Handler(logging.StreamHandler):
    """Writes to stdout through ``tqdm.write`` while a bar is drawn, so a log line does not tear the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        # Ray Train logs under a file-path logger name, hence site-packages
        if record.levelno == logging.INFO and logging.getLogger().level > logging.DEBUG \
                and (record.name.split(".")[0] in QUIET or "site-packages" in record.name):
            return
        try:
            msg = self.format(record)
            if Progress.active:
                tqdm.write(msg, file=sys.stdout)
            else:
                sys.stdout.write(msg + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must never take the job down
            self.handleError(record)


def setup(level: str | None = None) -> None:
    """Configure the root logger (one handler, ``FORMAT``, stdout) at ``level`` (default: ``$OSVL_LOG_LEVEL``,
    else info). Idempotent: a second call only changes the level."""
    level = (level or os.environ.get(ENV) or "info").lower()
    if level not in LEVELS:
        raise ConfigError(f"--log_level: {level!r} is not one of {', '.join(LEVELS)}")
    os.environ[ENV] = level  # for worker processes started after this (osvl.cluster.worker_env)
    root = logging.getLogger()
    if not any(isinstance(h, _Handler) for h in root.handlers):
        # a Ray worker's root logger already has a console handler (Ray's StreamHandler; in a Ray Train worker
        # its PlainRayHandler): two console handlers print every line twice. File handlers stay.
        for h in [h for h in root.handlers
                  if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]:
            root.removeHandler(h)
        handler = _Handler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def start_job(cls: type[T], job: str, argv: list[str] | None = None,
              finish: Callable[[T], T] | None = None, usage: str = "") -> T:
    """Every job's first line: ``--log_level`` read and applied, the config resolved (``osvl.config.parse_args``,
    then ``finish``: a job's own checks and additions, which fail before anything is logged) and logged.
    ``--print_config`` prints that config (what the job would log) and exits 0 before anything starts; ``usage``
    is ``--help``'s first line (``parse_args``)."""
    args = normalize_args(list(sys.argv[1:] if argv is None else argv))
    level = next((a.partition("=")[2] for a in args if a.startswith("--log_level=")), None)
    setup(level)
    cfg = parse_args(cls, job, [a for a in args if not a.startswith("--log_level=") and a != "--print_config"],
                     usage=usage)
    if finish is not None:
        cfg = finish(cfg)
    if "--print_config" in args:
        print(dump(cfg), end="", flush=True)
        raise SystemExit(0)
    log.info("%s config:\n%s", job, dump(cfg).rstrip())
    return cfg


class Progress:
    """``with Progress(total, "synthesize", "shards") as p: ... p.update(1)``: a bar or periodic lines.

    ``total`` may be None (a stream of unknown length): the bar then counts, the lines give the count.
    ``postfix`` values given to ``update`` (``loss=0.41``) are shown beside the count.
    """

    active = 0  # bars open in this process: the log handler writes around them

    def __init__(self, total: int | None, desc: str, unit: str = "it", every_s: float = 30.0,
                 initial: int = 0) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = self.initial = self.shown = initial
        self.t0 = self.t_last = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", initial=initial, file=sys.stderr,
                            dynamic_ncols=True, leave=True)
            Progress.active += 1

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        self.postfix.update(postfix)
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.t_last >= self.every_s or (self.total is not None and self.n >= self.total):
            self.t_last, self.shown = now, self.n
            log.info(self.line(now))

    def line(self, now: float) -> str:
        """The plain progress line: count, share, elapsed time, an estimate of what is left, the postfix."""
        el = now - self.t0
        text = f"{self.desc}: {self.n}"
        if self.total:
            text += f"/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)"
            done = self.n - self.initial  # a resumed job's earlier work took no time in this run
            if done > 0 and self.n < self.total:
                text += f", {el:.0f} s, ~{el / done * (self.total - self.n):.0f} s left"
            else:
                text += f", {el:.0f} s"
        else:
            text += f" {self.unit}, {el:.0f} s"
        extra = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.postfix.items())
        return text + (f" | {extra}" if extra else "")

    def close(self) -> None:
        """Close the bar; in plain mode log the last count unless a line already showed it."""
        if self.bar is None and self.n != self.shown:
            self.shown = self.n
            log.info(self.line(time.monotonic()))
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            Progress.active -= 1

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
