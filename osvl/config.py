"""Typed job configs: dataclasses, YAML profiles, dotted ``--key=value`` overrides.

One config dataclass per job (``jobs/*.py``). A job resolves its config in three
layers, later wins: the dataclass defaults, a YAML profile
(``configs/<job>/<profile>.yaml``, chosen with ``--profile=NAME`` or a path), and
dotted command-line overrides (``--rl.group_size=8``; lists are comma-separated).

Why dataclasses and not a config framework: the whole contract fits in this file,
every field is documented where it is declared (``opt(default, "doc")``), and an
unknown key or a wrong type fails loudly *before* any cluster starts.

Run-root convention (docs/design.md): every job writes under
``<run_root>/<job>/<config hash>/`` and saves its resolved config there as
``config.yaml``, so an identical rerun finds and reuses what an earlier one made.
The hash skips fields declared with ``opt(..., hashed=False)`` (paths of where to
write, worker counts) because they do not change what is produced, and sees a field
declared with ``hash_as`` through it (a tiny model kind as its checkpoint's name, which
changes with the weights and tokenizer behind the kind).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from osvl import storage
from osvl.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_RUN_ROOT = os.environ.get("OSVL_RUN_ROOT", str(REPO_ROOT / "runs"))
SHARED_DATA = "$OSVL_SHARED_DATA"  # how configs name the shared data folder (read-only inputs)


def input_path(value: str) -> Path:
    """An input path from a config: ``$OSVL_SHARED_DATA`` replaced by that environment variable (default:
    ``shared/data`` beside the checkout), then a relative path taken from the repo root.

    Why not a plain relative path: under ``ray job submit --working-dir .`` the job runs in Ray's
    unpacked copy of the checkout, beside which nothing else exists; the cluster's data folder
    reaches the job through the environment (``--runtime-env-json '{"env_vars": {...}}'``).
    """
    shared = os.environ.get("OSVL_SHARED_DATA") or str(REPO_ROOT.parent / "shared" / "data")
    path = Path(value.replace("${OSVL_SHARED_DATA}", SHARED_DATA).replace(SHARED_DATA, shared))
    return path if path.is_absolute() else (REPO_ROOT / path).resolve()

T = TypeVar("T")


def opt(default: Any, doc: str, *, hashed: bool = True, hash_as: Callable[[Any], Any] | None = None) -> Any:
    """Declare a config field with its documentation (shown by ``--help``).

    Mutable defaults (lists, dicts, nested configs) are wrapped in a factory so
    that two config objects never share one list; a function as ``default`` is that factory (an upstream
    stage's section starts from that job's profile: ``osvl.recipe``). ``hash_as`` maps the value to what
    the run hash sees, for a name whose meaning can change under it (a tiny model kind: its weights).
    """
    meta = {"doc": doc, "hashed": hashed, **({"hash_as": hash_as} if hash_as else {})}
    if inspect.isfunction(default) or dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class RunConfig:
    """Where a job writes and how it seeds itself; embedded in every job config as ``run``."""

    # a URI's credentials and endpoint come from the filesystem's standard environment (osvl/storage.py)
    root: str = opt(DEFAULT_RUN_ROOT, "Run root: <root>/<job>/<config hash>/; a folder or an s3://, gs://, file:// "
                    "URI (env OSVL_RUN_ROOT: default).", hashed=False)
    seed: int = opt(0, "Global random seed (Python, NumPy, torch, and per-shard seeds derive from it).")
    name: str = opt("", "Optional run name; when set it replaces the config hash as the folder name.",
                    hashed=False)
    # experiment tracking (osvl/tracking.py): where a job logs, not what it produces, hence not hashed
    tracking: list[Literal["tensorboard", "wandb", "mlflow"]] = opt(
        ["tensorboard"], "Where training and eval jobs log scalars (osvl/tracking.py): tensorboard (<run folder>/tb/), "
        "wandb, mlflow.", hashed=False)
    tracking_project: str = opt("", "W&B project / MLflow experiment name for run.tracking; empty = osvl.",
                                hashed=False)


# ---------------------------------------------------------------------------
# type checking and coercion


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if origin is dict:
        k, v = get_args(tp)
        return f"dict[{_type_name(k)}, {_type_name(v)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _check(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` where that is lossless (int -> float), else raise."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        # compare types too: True == 1 and 2.0 == 2, but neither is the literal 1 or 2
        if any(value == a and type(value) is type(a) for a in get_args(tp)):
            return value
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _check(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected None, got {value!r}")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item_tp,) = get_args(tp)
        return [_check(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__}")
        k_tp, v_tp = get_args(tp)
        return {_check(k, k_tp, key): _check(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and type(value) is tp:
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected float, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {type(value).__name__} {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _from_text(text: str, tp: Any, key: str) -> Any:
    """Parse a command-line string into ``tp`` (then ``_check`` validates it); ``Any`` keeps the text."""
    origin = get_origin(tp)
    if tp is Any:
        return text
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _check(_from_text(text, arg, key), arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: cannot read {text!r} as {_type_name(tp)}")
    if origin is list:
        (item_tp,) = get_args(tp)
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        return [_from_text(t, item_tp, f"{key}[{i}]") for i, t in enumerate(items)]
    if origin is Literal:
        for arg in get_args(tp):
            if str(arg) == text:
                return arg
        raise ConfigError(f"{key}: {text!r} is not {_type_name(tp)}")
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}: expected int, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {text!r}") from None
    if tp is str:
        return text
    if origin is dict or dataclasses.is_dataclass(tp):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{key}: expected a JSON object, got {text!r}") from None
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


# Keys renamed so that one concept has one name in every config: a stage's parallel processes are its `workers`
# (and what one reserves `cpus_per_worker`), episodes in flight per worker its `concurrency`, the tools a model is
# offered its `offer`, a warm-up as a share of the steps `warmup_share` (a count: `warmup_steps`). A config class
# lists its own old names in a class attribute, ``RENAMED: ClassVar[dict[str, str]] = {"old": "new"}``, so that a
# flag or a profile of an earlier version fails at start with the key to write instead (and an old name of one
# section says nothing about another's).


def _unknown(cls: type, key: str, name: str, valid: list[str]) -> ConfigError:
    new = getattr(cls, "RENAMED", {}).get(name)
    if new in valid:
        return ConfigError(f"config key {key!r} was renamed to {key[:len(key) - len(name)] + new!r}")
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys here: {', '.join(valid)}")


# ---------------------------------------------------------------------------
# public API


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build ``cls`` from a (possibly partial) nested mapping; missing keys keep defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    fields = _fields(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown(cls, prefix + str(name), str(name), sorted(fields))
        f, tp = fields[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            base = f.default_factory() if f.default_factory is not dataclasses.MISSING else tp()
            kwargs[name] = merge(base, value, prefix=prefix + name + ".")
        else:
            kwargs[name] = _check(value, tp, prefix + name)
    return cls(**kwargs)


def merge(cfg: T, data: dict[str, Any], prefix: str = "") -> T:
    """Return a copy of ``cfg`` with the (partial, nested) mapping ``data`` applied."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    fields = _fields(type(cfg))
    changes = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown(type(cfg), prefix + str(name), str(name), sorted(fields))
        _, tp = fields[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            changes[name] = merge(getattr(cfg, name), value, prefix=prefix + name + ".")
        else:
            changes[name] = _check(value, tp, prefix + name)
    return dataclasses.replace(cfg, **changes)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (YAML/JSON-serialisable)."""
    return dataclasses.asdict(cfg)


def parse_value(cls: type, dotted: str, text: str, prefix: str = "") -> Any:
    """The command-line ``text`` of field ``dotted`` of ``cls``, read and checked by that field's type.

    ``prefix`` is where ``cls`` sits in a larger config (``synth.`` for jobs/grpo.py's sub-job
    overrides), so that an error names the key the user typed.
    """
    parts = dotted.split(".")
    tp: Any = cls
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{prefix}{'.'.join(parts[:i])} is not a section; cannot set {prefix + dotted!r}")
        fields = _fields(tp)
        if part not in fields:
            raise _unknown(tp, prefix + dotted, part, sorted(fields))
        tp = fields[part][1]
    value = _from_text(text, tp, prefix + dotted)
    # a section given as JSON stays a mapping, which merges into the section instead of replacing it
    return value if dataclasses.is_dataclass(tp) else _check(value, tp, prefix + dotted)


def apply_override(cfg: T, dotted: str, text: str) -> T:
    """Apply one ``dotted.key=text`` override, parsing ``text`` by the field's type."""
    nested: Any = parse_value(type(cfg), dotted, text)
    for part in reversed(dotted.split(".")):
        nested = {part: nested}
    return merge(cfg, nested)


def load_yaml(path: str | Path) -> dict[str, Any]:
    class Loader(yaml.SafeLoader):
        """PyYAML follows YAML 1.1, where ``1e-3`` (no dot) is a *string*; configs write
        learning rates that way, so such numbers are read as floats here (YAML 1.2)."""

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=Loader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def profile_path(job: str, profile: str) -> Path:
    """A profile is a name under ``configs/<job>/`` or a path to a YAML file."""
    p = Path(profile)
    if p.suffix in (".yaml", ".yml"):
        return p
    path = CONFIG_DIR / job / f"{profile}.yaml"
    if not path.is_file():
        names = sorted(x.stem for x in (CONFIG_DIR / job).glob("*.yaml"))
        raise ConfigError(f"no profile {profile!r} for job {job!r}; available: {', '.join(names) or 'none'}")
    return path


def usage_line(job: str) -> str:
    """The first line of a job's ``--help``."""
    return (f"usage: python jobs/{job}.py [--profile=NAME|FILE.yaml] [--print_config] "
            "[--log_level=debug|info|warning|error] [--section.key=value | --section.key value ...]")


def format_help(cls: type, job: str = "", prefix: str = "", defaults: Any = None, usage: str = "",
                profile: str = "") -> str:
    """Every field with its type, value and doc: what ``--help`` prints.

    Values are read from an instance (``defaults``, else ``cls()``) rather than from the class
    fields, so help shows what a run with the selected profile (and any overrides) gets.
    """
    lines = []
    if not prefix:
        lines.append(usage or usage_line(job))
        profiles = sorted(x.stem for x in (CONFIG_DIR / job).glob("*.yaml")) if job else []
        if profiles:
            lines.append(f"profiles: {', '.join(profiles)} (default: demo)")
        if profile:
            lines.append(f"values below: profile {profile!r} over the defaults, then the overrides given")
        lines.append("")
    obj = cls() if defaults is None else defaults
    for name, (f, tp) in _fields(cls).items():
        key = prefix + name
        doc = f.metadata.get("doc", "")
        value = getattr(obj, name)
        if dataclasses.is_dataclass(tp):
            lines.append(f"[{key}] {doc}")
            lines.append(format_help(tp, prefix=key + ".", defaults=value))
            continue
        lines.append(f"  --{key}={json.dumps(value)}  ({_type_name(tp)})\n      {doc}")
    return "\n".join(lines)


def _hashed_dict(cfg: Any) -> dict[str, Any]:
    out = {}
    for name, (f, tp) in _fields(type(cfg)).items():
        if not f.metadata.get("hashed", True):
            continue
        value = getattr(cfg, name)
        if f.metadata.get("hash_as"):
            value = f.metadata["hash_as"](value)
        out[name] = _hashed_dict(value) if dataclasses.is_dataclass(tp) else value
    return out


def config_hash(cfg: Any) -> str:
    """12-hex digest of the fields that change what a job produces."""
    blob = json.dumps(_hashed_dict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_dir(cfg: Any, job: str) -> Path:
    """``<run.root>/<job>/<name or config hash>``; created, with ``config.yaml`` saved in it.

    A remote root (``s3://...``, ``gs://...``) gives the node-local mirror of that folder,
    filled from storage (``osvl.storage``); the job publishes what it finishes back.
    """
    run = cfg.run
    folder = run.name or config_hash(cfg)
    storage.open_root(run.root, "run.root")  # a bad root fails here, before anything is written
    if storage.is_remote(run.root):
        path = storage.mirror(storage.join(run.root, job, folder))
    else:
        path = Path(str(run.root).removeprefix("file://")) / job / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    storage.publish(path, "config.yaml")
    return path


BARE_FLAGS = frozenset({"help", "print_config"})  # flags that never take a value


def normalize_args(argv: Sequence[str]) -> list[str]:
    """Command-line arguments as ``--key=value``: ``--key value`` joined, a lone ``--key`` (a bool) read as
    ``--key=true``, ``-h`` as ``--help``. ``BARE_FLAGS`` stay as they are (``--help``, ``--print_config``)."""
    out, i = [], 0
    while i < len(argv):
        arg = "--help" if argv[i] == "-h" else argv[i]
        key = arg[2:]
        if not arg.startswith("--") or "=" in arg or key in BARE_FLAGS:
            out.append(arg)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "-h":  # "-1" is a value
            out.append(f"{arg}={argv[i + 1]}")
            i += 1
        else:
            out.append(f"{arg}=true")
        i += 1
    return out


def parse_args(cls: type[T], job: str, argv: list[str] | None = None,
               default_profile: str = "demo", usage: str = "") -> T:
    """Resolve a job's config from defaults, a profile and overrides (``--key=value`` or ``--key value``).

    ``--help`` prints every field with the value this command line resolves to and exits 0 (``usage``
    replaces the first line: a job with flags outside its config names them there); anything malformed
    raises ConfigError (``cli`` turns it into one line and exit code 2).
    """
    argv = normalize_args(list(sys.argv[1:] if argv is None else argv))
    profile = default_profile
    overrides: list[tuple[str, str]] = []
    for arg in argv:
        if arg == "--help":
            continue
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"arguments look like --section.key=value, got {arg!r}")
        key, _, value = arg[2:].partition("=")
        if key == "profile":
            profile = value
        else:
            overrides.append((key, value))
    cfg = cls()
    if profile:
        cfg = merge(cfg, load_yaml(profile_path(job, profile)))
    for key, value in overrides:
        cfg = apply_override(cfg, key, value)
    if "--help" in argv:
        print(format_help(cls, job, defaults=cfg, profile=profile, usage=usage))
        raise SystemExit(0)
    return cfg


def cli(main: Callable[[], Any]) -> None:
    """Run an entry point's ``main`` (every ``jobs/*.py`` and ``serve`` app): a ``ConfigError`` (a misspelt
    key, a bad value, a missing profile) prints one line, not a traceback, and exits with code 2."""
    try:
        main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def script_flags(argv: Sequence[str], defaults: Mapping[str, Any], *,
                 rest: bool = False) -> tuple[dict[str, Any], list[str]]:
    """A script's own flags (``--name=value``; ``--name`` alone sets a bool), typed like their ``defaults``.

    With ``rest`` the other arguments are returned for ``parse_args`` (a bench that also takes a job's
    ``--section.key=value`` overrides); without, any other argument is a ``ConfigError``, so a mistyped
    flag is not silently ignored.
    """
    flags, others = dict(defaults), []
    for arg in argv:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in defaults:
            others.append(arg)
            continue
        kind = type(defaults[name])
        if kind is bool:
            flags[name] = value.lower() not in ("0", "false", "no") if eq else True
            continue
        try:
            flags[name] = kind(value)
        except ValueError:
            raise ConfigError(f"--{name}: {value!r} is not {kind.__name__}") from None
    if others and not rest:
        raise ConfigError(f"unknown arguments {others}; this script takes "
                          + ", ".join(f"--{k}={v}" for k, v in defaults.items()))
    return flags, others


def upstream_config(cls: type[T], job: str, run: RunConfig, overrides: dict[str, Any] | None = None) -> T:
    """The config of a job another one builds on (or reuses): its demo profile, the downstream run's root and
    seed, then ``overrides``. Every "build or reuse the upstream job" goes through here, so an identical
    request lands in the same run folder (``run_dir``) and is reused there."""
    cfg = parse_args(cls, job, [f"--run.root={run.root}", f"--run.seed={run.seed}"])
    return merge(cfg, overrides or {})


def dump(cfg: Any) -> str:
    """The resolved config as YAML, printed by every job at start."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
