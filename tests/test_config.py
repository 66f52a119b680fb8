"""osvl/config.py: defaults, YAML profiles, dotted overrides, errors, --help, hashing, run folders."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, Optional  # noqa: UP035 - Optional is a spelling configs may use

import pytest
import yaml

from osvl import config as C
from osvl.config import (
    RunConfig,
    apply_override,
    config_hash,
    dump,
    format_help,
    from_dict,
    load_yaml,
    merge,
    opt,
    parse_args,
    profile_path,
    run_dir,
    script_flags,
    to_dict,
)
from osvl.errors import ConfigError


@dataclasses.dataclass
class Model:
    hidden: int = opt(16, "Hidden size.")
    dropout: float = opt(0.1, "Dropout probability.")
    act: Literal["gelu", "relu"] = opt("gelu", "Activation.")
    cache: str = opt("", "Where to cache (does not change results).", hashed=False)


@dataclasses.dataclass
class Job:
    run: RunConfig = opt(RunConfig, "Run root and seed.")
    model: Model = opt(Model, "The model.")
    big: Model = opt(Model(hidden=64), "A second, bigger model.")
    lr: float = opt(3e-4, "Learning rate.")
    steps: int = opt(10, "Training steps.")
    use_kl: bool = opt(True, "Use a KL term.")
    label: str = opt("demo", "Experiment label.")
    limit: int | None = opt(None, "Optional cap.")
    note: Optional[str] = opt("x", "Optional note.")  # noqa: UP045
    mode: Literal["vanilla", "fatal_mask"] = opt("vanilla", "Loss mode.")
    level: Literal[1, 2] = opt(1, "Level.")
    layers: list[int] = opt([1, 2], "Layer ids.")
    tags: list[str] = opt([], "Tags.")
    weights: dict[str, float] = opt({"a": 1.0}, "Weights.")
    either: int | str = opt(0, "An int or a name.")
    extra: Any = opt(None, "Anything.")
    workers: int = opt(2, "Worker count.", hashed=False)


@dataclasses.dataclass
class Mixed:
    sec: Model  # a required section: from_dict builds it from the class
    plain: int = 3  # declared without opt: no doc, hashed
    maybe: Model | None = opt(None, "An optional section.")
    stages: list[Model] = opt([], "Sections in a list.")
    floor: None | int = opt(None, "None spelled first.")


def err(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.fixture
def configs_dir(tmp_path, monkeypatch):
    """A configs/ root with two profiles of job 'toy' (CONFIG_DIR is where profile names resolve)."""
    root = tmp_path / "configs"
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "demo.yaml").write_text("steps: 3\nmodel:\n  hidden: 8\n")
    (root / "toy" / "production.yml.bak").write_text("ignored: 1\n")
    (root / "toy" / "production.yaml").write_text("steps: 1000\nlr: 1e-5\n")
    (root / "stray.yaml").write_text("steps: 1\n")  # not a profile of any job
    monkeypatch.setattr(C, "CONFIG_DIR", root)
    return root


# ---------------------------------------------------------------------------
# declaring fields


def test_defaults():
    cfg = Job()
    assert cfg.run == RunConfig(root=C.DEFAULT_RUN_ROOT, seed=0, name="")
    assert cfg.model == Model(hidden=16, dropout=0.1, act="gelu", cache="")
    assert cfg.big.hidden == 64 and cfg.lr == 3e-4 and cfg.steps == 10 and cfg.use_kl is True
    assert (cfg.label, cfg.limit, cfg.note, cfg.mode, cfg.level) == ("demo", None, "x", "vanilla", 1)
    assert (cfg.layers, cfg.tags, cfg.weights, cfg.either, cfg.extra, cfg.workers) == ([1, 2], [], {"a": 1.0}, 0,
                                                                                       None, 2)


def test_opt_metadata_and_fresh_mutable_defaults():
    fields = {f.name: f for f in dataclasses.fields(Job)}
    assert dict(fields["lr"].metadata) == {"doc": "Learning rate.", "hashed": True}
    assert dict(fields["workers"].metadata) == {"doc": "Worker count.", "hashed": False}
    assert fields["lr"].default == 3e-4 and fields["lr"].default_factory is dataclasses.MISSING
    a, b = Job(), Job()
    a.layers.append(3)
    a.weights["b"] = 2.0
    a.model.hidden = 1
    a.big.hidden = 2
    assert (b.layers, b.weights, b.model.hidden, b.big.hidden) == ([1, 2], {"a": 1.0}, 16, 64)
    run_fields = {f.name: f.metadata["hashed"] for f in dataclasses.fields(RunConfig)}
    assert run_fields == {"root": False, "seed": True, "name": False, "tracking": False, "tracking_project": False}


def test_opt_builds_fields():
    f = opt(3, "three")
    assert f.default == 3 and f.default_factory is dataclasses.MISSING
    assert dict(f.metadata) == {"doc": "three", "hashed": True}
    assert dict(opt(3, "d", hashed=False).metadata) == {"doc": "d", "hashed": False}
    assert opt(str, "a type as a plain value").default is str
    nested = [[1], {"a": [2]}]
    f = opt(nested, "nested list")
    assert f.default is dataclasses.MISSING and dict(f.metadata) == {"doc": "nested list", "hashed": True}
    got = f.default_factory()
    assert got == nested and got is not nested and got[0] is not nested[0] and got[1]["a"] is not nested[1]["a"]
    f = opt({"k": [1]}, "dict", hashed=False)
    f.default_factory()["k"].append(2)
    assert f.default_factory() == {"k": [1]} and dict(f.metadata) == {"doc": "dict", "hashed": False}
    f = opt(Model, "section type")
    assert f.default_factory is Model and dict(f.metadata) == {"doc": "section type", "hashed": True}
    m = Model(hidden=3)
    f = opt(m, "section instance", hashed=False)
    got = f.default_factory()
    assert got == m and got is not m and dict(f.metadata) == {"doc": "section instance", "hashed": False}


def test_sections_in_unions_lists_and_required():
    cfg = from_dict(Mixed, {"sec": {"hidden": 3}})
    assert cfg == Mixed(sec=Model(hidden=3), plain=3, maybe=None, stages=[], floor=None)
    cfg = from_dict(Mixed, {"sec": {}, "maybe": {"hidden": 2}, "stages": [{"hidden": 1}, {"act": "relu"}]})
    assert cfg.maybe == Model(hidden=2) and cfg.stages == [Model(hidden=1), Model(act="relu")]
    assert err(from_dict, Mixed, {"sec": {}, "stages": [{"hidden": "x"}]}) == \
        "stages[0].hidden: expected int, got str 'x'"
    assert err(from_dict, Mixed, {"sec": {}, "stages": [{}, {"hiden": 1}]}).startswith(
        "unknown config key 'stages[1].hiden' (did you mean 'hidden'?)")
    assert err(from_dict, Mixed, {"sec": {}, "stages": [3]}) == "stages[0]: expected a mapping for section Model, got 3"
    assert err(from_dict, Mixed, {"sec": {}, "maybe": {"hiden": 1}}) == \
        "maybe: {'hiden': 1} is not Model | None"
    cfg = Mixed(sec=Model())
    assert apply_override(cfg, "floor", "5").floor == 5 and apply_override(cfg, "floor", "none").floor is None
    assert err(apply_override, cfg, "floor", "x") == "floor: cannot read 'x' as None | int"
    assert C._hashed_dict(cfg) == {"sec": {"hidden": 16, "dropout": 0.1, "act": "gelu"}, "plain": 3, "maybe": None,
                                   "stages": [], "floor": None}
    assert format_help(Mixed, defaults=cfg).split("\n")[2:7] == [
        "[sec] ", "  --sec.hidden=16  (int)", "      Hidden size.", "  --sec.dropout=0.1  (float)",
        "      Dropout probability."]
    assert "  --plain=3  (int)\n      \n  --maybe=null  (Model | None)\n      An optional section." \
        in format_help(Mixed, defaults=cfg)


def test_default_run_root_follows_env(tmp_path):
    code = "from osvl import config; print(config.DEFAULT_RUN_ROOT); print(config.RunConfig().root)"
    env = {**os.environ, "OSVL_RUN_ROOT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(tmp_path)] * 2
    env.pop("OSVL_RUN_ROOT")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(C.REPO_ROOT / "runs")] * 2
    assert C.CONFIG_DIR == C.REPO_ROOT / "configs" and (C.REPO_ROOT / "osvl" / "config.py").is_file()


# ---------------------------------------------------------------------------
# dotted overrides, one per type


@pytest.mark.parametrize("key, text, value", [
    ("steps", "12", 12), ("steps", "-3", -3), ("steps", "1_000", 1000),
    ("lr", "1e-3", 1e-3), ("lr", "2", 2.0), ("lr", "inf", float("inf")),
    ("label", "a, b = c", "a, b = c"), ("label", "", ""),
    ("limit", "7", 7), ("limit", "none", None), ("limit", "NULL", None), ("limit", "None", None),
    ("note", "hello", "hello"), ("note", "null", None),
    ("mode", "fatal_mask", "fatal_mask"), ("level", "2", 2),
    ("layers", "3, 4,5", [3, 4, 5]), ("layers", "", []), ("layers", "  ", []), ("layers", "7", [7]),
    ("tags", "a,b c", ["a", "b c"]),
    ("weights", '{"b": 2}', {"b": 2.0}),
    ("either", "5", 5), ("either", "five", "five"), ("either", "none", "none"),
    ("extra", "anything", "anything"),
    ("workers", "8", 8),
])
def test_override_each_type(key, text, value):
    cfg = apply_override(Job(), key, text)
    got = getattr(cfg, key)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["true", "True", "1", "yes", "YES", "on", "On"])
def test_bool_true_spellings(text):
    assert apply_override(Job(use_kl=False), "use_kl", text).use_kl is True


@pytest.mark.parametrize("text", ["false", "FALSE", "0", "no", "No", "off", "OFF"])
def test_bool_false_spellings(text):
    assert apply_override(Job(), "use_kl", text).use_kl is False


def test_nested_overrides():
    cfg = apply_override(Job(), "model.hidden", "32")
    cfg = apply_override(cfg, "model.act", "relu")
    cfg = apply_override(cfg, "run.seed", "5")
    assert cfg.model == Model(hidden=32, dropout=0.1, act="relu") and cfg.run.seed == 5
    assert cfg.big.hidden == 64 and Job().model.hidden == 16  # the original is untouched
    cfg = apply_override(cfg, "big", '{"dropout": 0.5}')  # a whole section as JSON merges into it
    assert cfg.big == Model(hidden=64, dropout=0.5)


@pytest.mark.parametrize("key, text, message", [
    ("steps", "1.5", "steps: expected int, got '1.5'"),
    ("steps", "ten", "steps: expected int, got 'ten'"),
    ("lr", "fast", "lr: expected float, got 'fast'"),
    ("use_kl", "maybe", "use_kl: expected bool (true/false), got 'maybe'"),
    ("use_kl", "", "use_kl: expected bool (true/false), got ''"),
    ("limit", "lots", "limit: cannot read 'lots' as int | None"),
    ("mode", "fatal", "mode: 'fatal' is not one of 'vanilla', 'fatal_mask'"),
    ("level", "3", "level: '3' is not one of 1, 2"),
    ("layers", "1,x", "layers[1]: expected int, got 'x'"),
    ("weights", "a=1", "weights: expected a JSON object, got 'a=1'"),
    ("weights", '{"a": "x"}', "weights.a: expected float, got str 'x'"),
    ("weights", "[1]", "weights: expected dict[str, float], got list"),
    ("model", "{", "model: expected a JSON object, got '{'"),
    ("model", '{"hidden": "x"}', "model.hidden: expected int, got str 'x'"),
    ("lr.x", "1", "lr is not a section; cannot set 'lr.x'"),
    ("model.hidden.x", "1", "model.hidden is not a section; cannot set 'model.hidden.x'"),
])
def test_override_errors(key, text, message):
    assert err(apply_override, Job(), key, text) == message


def test_unknown_keys_name_valid_ones_and_suggest():
    assert err(apply_override, Job(), "model.hiden", "3") == (
        "unknown config key 'model.hiden' (did you mean 'hidden'?); valid keys here: act, cache, dropout, hidden")
    assert err(apply_override, Job(), "stpes", "3").startswith(
        "unknown config key 'stpes' (did you mean 'steps'?); valid keys here: big, either, extra, label, layers,")
    assert err(apply_override, Job(), "zzz", "3") == (
        "unknown config key 'zzz'; valid keys here: big, either, extra, label, layers, level, limit, lr, mode, "
        "model, note, run, steps, tags, use_kl, weights, workers")
    assert err(merge, Job(), {"model": {"hiden": 3}}).startswith("unknown config key 'model.hiden' (did you mean")
    assert err(from_dict, Job, {"run": {"sed": 3}}) == (
        "unknown config key 'run.sed' (did you mean 'seed'?); valid keys here: name, root, seed, tracking, "
        "tracking_project")
    assert err(from_dict, Job, {"big": {"x": 1}}, prefix="p.").startswith("unknown config key 'p.big.x'; valid")
    assert err(from_dict, Job, {"lbl": 1}, prefix="p.") == (
        "unknown config key 'p.lbl' (did you mean 'label'?); valid keys here: big, either, extra, label, layers, "
        "level, limit, lr, mode, model, note, run, steps, tags, use_kl, weights, workers")


def test_unsupported_field_type():
    @dataclasses.dataclass
    class Odd:
        s: set[int] = opt(frozenset(), "A set.")

    assert err(apply_override, Odd(), "s", "1") == "s: unsupported field type set[int]"
    assert err(merge, Odd(), {"s": [1]}) == "s: unsupported field type set[int]"


# ---------------------------------------------------------------------------
# values from YAML / mappings


@pytest.mark.parametrize("data, message", [
    ({"steps": "3"}, "steps: expected int, got str '3'"),
    ({"steps": True}, "steps: expected int, got bool True"),
    ({"steps": 3.0}, "steps: expected int, got float 3.0"),
    ({"lr": "fast"}, "lr: expected float, got str 'fast'"),
    ({"lr": True}, "lr: expected float, got bool True"),
    ({"use_kl": 1}, "use_kl: expected bool, got int 1"),
    ({"label": 3}, "label: expected str, got int 3"),
    ({"label": None}, "label: expected str, got NoneType None"),
    ({"limit": "3"}, "limit: '3' is not int | None"),
    ({"note": 3}, "note: 3 is not str | None"),
    ({"mode": "x"}, "mode: 'x' is not one of 'vanilla', 'fatal_mask'"),
    ({"level": True}, "level: True is not one of 1, 2"),
    ({"level": 2.0}, "level: 2.0 is not one of 1, 2"),
    ({"layers": "1,2"}, "layers: expected list[int], got str '1,2'"),
    ({"layers": [1, "2"]}, "layers[1]: expected int, got str '2'"),
    ({"weights": [1]}, "weights: expected dict[str, float], got list"),
    ({"weights": {1: 1.0}}, "weights: expected str, got int 1"),
    ({"weights": {"a": "b"}}, "weights.a: expected float, got str 'b'"),
    ({"model": 3}, "model: expected a mapping for section Model, got 3"),
    ({"model": RunConfig()}, "model: expected a mapping for section Model, got RunConfig("),
    ({"model": {"hidden": "x"}}, "model.hidden: expected int, got str 'x'"),
])
def test_wrong_types(data, message):
    assert err(merge, Job(), data).startswith(message)
    assert err(from_dict, Job, data).startswith(message)


def test_good_values_are_converted():
    cfg = from_dict(Job, {"lr": 1, "layers": (3, 4), "weights": {"b": 2}, "level": 2, "limit": 4,
                          "model": {"dropout": 0}, "extra": {"any": [1]}})
    assert type(cfg.lr) is float and cfg.lr == 1.0
    assert cfg.layers == [3, 4] and type(cfg.layers) is list
    assert cfg.weights == {"b": 2.0} and type(cfg.weights["b"]) is float
    assert type(cfg.model.dropout) is float and cfg.model.hidden == 16
    assert (cfg.level, cfg.limit, cfg.extra) == (2, 4, {"any": [1]})
    assert from_dict(Job, {"note": None, "limit": None}).note is None
    model = Model(hidden=3)
    assert merge(Job(), {"model": model}).model is model


def test_partial_sections_keep_their_defaults():
    assert from_dict(Job, {"big": {"dropout": 0.5}}).big == Model(hidden=64, dropout=0.5)
    assert from_dict(Job, {"model": {}}).model == Model()
    cfg = merge(Job(big=Model(hidden=5)), {"big": {"act": "relu"}})
    assert cfg.big == Model(hidden=5, act="relu")  # merge keeps the current values, not the defaults
    assert from_dict(Job, {}) == Job()


def test_mapping_required():
    assert err(from_dict, Job, [1]) == "config: expected a mapping, got [1]"
    assert err(from_dict, Job, "x", prefix="sec.") == "sec.: expected a mapping, got 'x'"
    assert err(merge, Job(), None) == "config: expected a mapping, got None"
    assert err(merge, Job(), 3, prefix="sec.") == "sec.: expected a mapping, got 3"


def test_type_names():
    tn = C._type_name
    assert tn(Literal["a", "b"]) == "one of 'a', 'b'"
    assert tn(int | None) == "int | None"
    assert tn(Optional[str]) == "str | None"  # noqa: UP045
    assert tn(list[int]) == "list[int]"
    assert tn(dict[str, list[float]]) == "dict[str, list[float]]"
    assert tn(type(None)) == "None"
    assert tn(Model) == "Model"
    assert tn(C._check(None, type(None), "k")) == "None"
    assert err(C._check, 1, type(None), "k") == "k: expected None, got 1"
    assert C._check(object, Any, "k") is object


# ---------------------------------------------------------------------------
# YAML files and profiles


def test_load_yaml(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("lr: 1e-3\nb: 5E+2\nc: -2e-4\nd: 1.5e3\ne: 10\nf: 1_000\ng: e5\nh: 1e\ni: true\nj: 2.5\n")
    got = load_yaml(p)
    assert got == {"lr": 1e-3, "b": 500.0, "c": -2e-4, "d": 1500.0, "e": 10, "f": 1000, "g": "e5", "h": "1e",
                   "i": True, "j": 2.5}
    assert [type(got[k]) for k in "lrbcdef"[2:]] == [float, float, float, int, int]
    assert type(got["lr"]) is float
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(str(tmp_path / "empty.yaml")) == {}
    (tmp_path / "null.yaml").write_text("~\n")
    assert load_yaml(tmp_path / "null.yaml") == {}


def test_load_yaml_errors(tmp_path):
    assert err(load_yaml, tmp_path / "no.yaml") == f"config file not found: {tmp_path / 'no.yaml'}"
    assert err(load_yaml, tmp_path) == f"config file not found: {tmp_path}"
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    assert err(load_yaml, tmp_path / "bad.yaml").startswith(f"{tmp_path / 'bad.yaml'}: not valid YAML: ")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert err(load_yaml, tmp_path / "list.yaml") == f"{tmp_path / 'list.yaml'}: top level must be a mapping, got list"
    (tmp_path / "str.yaml").write_text("hello\n")
    assert err(load_yaml, tmp_path / "str.yaml").endswith("top level must be a mapping, got str")


def test_profile_path(configs_dir, tmp_path):
    assert profile_path("toy", "demo") == configs_dir / "toy" / "demo.yaml"
    assert profile_path("toy", "production") == configs_dir / "toy" / "production.yaml"
    assert profile_path("toy", "elsewhere/x.yaml") == Path("elsewhere/x.yaml")  # a path, not a name
    assert profile_path("other", "y.yml") == Path("y.yml")
    assert err(profile_path, "toy", "prod") == "no profile 'prod' for job 'toy'; available: demo, production"
    assert err(profile_path, "nojob", "demo") == "no profile 'demo' for job 'nojob'; available: none"
    # a .yml/.yaml suffix makes it a path, whose existence is checked when it is loaded
    assert profile_path("toy", "production.yml") == Path("production.yml")
    assert err(parse_args, Job, "toy", ["--profile=missing.yml"]) == "config file not found: missing.yml"


def test_parse_args_layers(configs_dir, tmp_path):
    assert parse_args(Job, "toy", [], default_profile="") == Job()
    cfg = parse_args(Job, "toy", [])  # default profile demo
    assert (cfg.steps, cfg.model.hidden, cfg.lr) == (3, 8, 3e-4)
    cfg = parse_args(Job, "toy", ["--profile=production"])
    assert (cfg.steps, cfg.lr, cfg.model.hidden) == (1000, 1e-5, 16)
    own = tmp_path / "own.yaml"
    own.write_text("steps: 7\nmodel: {act: relu}\nlayers: [9]\n")
    # overrides win over the profile wherever --profile appears
    cfg = parse_args(Job, "toy", ["--steps=8", f"--profile={own}", "--model.hidden=2", "--tags=x,y"])
    assert (cfg.steps, cfg.model.hidden, cfg.model.act, cfg.layers, cfg.tags) == (8, 2, "relu", [9], ["x", "y"])
    assert parse_args(Job, "toy", ["--profile=", "--label=a=b"]) == Job(label="a=b")
    assert parse_args(Job, "toy", ["--profile=demo", "--profile=production"]).steps == 1000
    cfg = parse_args(Job, "toy", ["--steps=1", "--steps=2"], default_profile="production")
    assert (cfg.steps, cfg.lr) == (2, 1e-5)


def test_parse_args_reads_sys_argv(configs_dir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["jobs/toy.py", "--steps=4"])
    assert parse_args(Job, "toy").steps == 4
    monkeypatch.setattr(sys, "argv", ["jobs/toy.py"])
    assert parse_args(Job, "toy").steps == 3


@pytest.mark.parametrize("argv, message", [
    (["steps=3"], "arguments look like --section.key=value, got 'steps=3'"),
    (["--steps"], "steps: expected int, got 'true'"),  # a lone --key is a bool's true
    (["--steps", "3", "9"], "arguments look like --section.key=value, got '9'"),
    (["-steps=3"], "arguments look like --section.key=value, got '-steps=3'"),
    (["--stpes=3"], "unknown config key 'stpes' (did you mean 'steps'?)"),
    (["--profile=nope"], "no profile 'nope' for job 'toy'; available: demo, production"),
])
def test_parse_args_errors(configs_dir, argv, message):
    assert err(parse_args, Job, "toy", argv).startswith(message)


def test_yaml_profile_errors(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("model:\n  hiden: 3\n")
    assert err(parse_args, Job, "toy", [f"--profile={p}"]).startswith(
        "unknown config key 'model.hiden' (did you mean 'hidden'?)")
    p.write_text("lr: fast\n")
    assert err(parse_args, Job, "toy", [f"--profile={p}"]) == "lr: expected float, got str 'fast'"


# ---------------------------------------------------------------------------
# --help


HELP = """\
usage: python jobs/toy.py [--profile=NAME|FILE.yaml] [--print_config] [--log_level=debug|info|warning|error] \
[--section.key=value | --section.key value ...]
profiles: demo, production (default: demo)
values below: profile 'demo' over the defaults, then the overrides given

[run] Run root and seed.
  --run.root="{root}"  (str)
      Run root: <root>/<job>/<config hash>/; a folder or an s3://, gs://, file:// URI (env OSVL_RUN_ROOT: default).
  --run.seed=0  (int)
      Global random seed (Python, NumPy, torch, and per-shard seeds derive from it).
  --run.name=""  (str)
      Optional run name; when set it replaces the config hash as the folder name.
  --run.tracking=["tensorboard"]  (list[one of 'tensorboard', 'wandb', 'mlflow'])
      Where training and eval jobs log scalars (osvl/tracking.py): tensorboard (<run folder>/tb/), wandb, mlflow.
  --run.tracking_project=""  (str)
      W&B project / MLflow experiment name for run.tracking; empty = osvl.
[model] The model.
  --model.hidden=8  (int)
      Hidden size.
  --model.dropout=0.1  (float)
      Dropout probability.
  --model.act="gelu"  (one of 'gelu', 'relu')
      Activation.
  --model.cache=""  (str)
      Where to cache (does not change results).
[big] A second, bigger model.
  --big.hidden=64  (int)
      Hidden size.
  --big.dropout=0.1  (float)
      Dropout probability.
  --big.act="gelu"  (one of 'gelu', 'relu')
      Activation.
  --big.cache=""  (str)
      Where to cache (does not change results).
  --lr=0.0003  (float)
      Learning rate.
  --steps=5  (int)
      Training steps.
  --use_kl=true  (bool)
      Use a KL term.
  --label="demo"  (str)
      Experiment label.
  --limit=null  (int | None)
      Optional cap.
  --note="x"  (str | None)
      Optional note.
  --mode="vanilla"  (one of 'vanilla', 'fatal_mask')
      Loss mode.
  --level=1  (one of 1, 2)
      Level.
  --layers=[1, 2]  (list[int])
      Layer ids.
  --tags=[]  (list[str])
      Tags.
  --weights={{"a": 1.0}}  (dict[str, float])
      Weights.
  --either=0  (int | str)
      An int or a name.
  --extra=null  (Any)
      Anything.
  --workers=2  (int)
      Worker count."""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_field_with_the_value_this_command_line_gives_it(configs_dir, capsys, flag):
    """The profile's values (demo: model.hidden 8) and the overrides (steps 5), not the defaults (16, 10)."""
    with pytest.raises(SystemExit) as info:
        parse_args(Job, "toy", ["--steps", "5", flag])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == HELP.format(root=C.DEFAULT_RUN_ROOT) + "\n"
    assert format_help(Job, "toy", defaults=parse_args(Job, "toy", ["--steps=5"]), profile="demo") == out[:-1]
    assert err(parse_args, Job, "toy", ["--steps=notanint", flag]) == "steps: expected int, got 'notanint'"


def test_help_without_profiles_or_job(configs_dir):
    text = format_help(RunConfig, "nojob")
    assert text.startswith("usage: python jobs/nojob.py [--profile=NAME|FILE.yaml] [--print_config] "
                           "[--log_level=debug|info|warning|error] [--section.key=value | --section.key value ...]"
                           "\n\n  --root=")
    assert format_help(RunConfig).startswith("usage: python jobs/.py [--profile")
    assert "profiles:" not in format_help(Job)
    shown = format_help(Model, prefix="m.", defaults=Model(hidden=5))
    assert shown.startswith("  --m.hidden=5  (int)\n      Hidden size.\n  --m.dropout=0.1")


# ---------------------------------------------------------------------------
# hashing and run folders


def test_config_hash_is_pinned_and_skips_unhashed_fields(tmp_path):
    base = Job()
    h = config_hash(base)
    assert h == "e63b2ac71dcc"  # a change here re-keys every run folder: do it on purpose
    assert len(h) == 12 and int(h, 16) >= 0
    same = [Job(workers=9), Job(run=RunConfig(root=str(tmp_path), name="x")), Job(model=Model(cache="/tmp/c"))]
    assert all(config_hash(c) == h for c in same)
    changed = [Job(lr=1e-3), Job(run=RunConfig(seed=1)), Job(model=Model(hidden=17)), Job(layers=[2, 1]),
               Job(weights={"a": 1.0, "b": 0.0}), Job(mode="fatal_mask"), Job(limit=0), Job(note=None)]
    hashes = {config_hash(c) for c in changed}
    assert h not in hashes and len(hashes) == len(changed)
    assert config_hash(Job(extra=Path("p"))) == config_hash(Job(extra="p"))  # non-JSON values hash as str
    assert C._hashed_dict(Job())["run"] == {"seed": 0}
    assert "workers" not in C._hashed_dict(Job()) and "cache" not in C._hashed_dict(Job())["model"]
    assert config_hash(Job(weights={"b": 1.0, "a": 2.0})) == config_hash(Job(weights={"a": 2.0, "b": 1.0}))


def test_sft_run_key_follows_the_model_behind_a_tiny_kind(monkeypatch):
    """A tiny kind names a build (tokenizer, weights) that a code or corpus change replaces: the SFT and
    trajectories runs (and the GRPO run that embeds their configs) must get new folders then, not resume
    a checkpoint or reuse records of the old build."""
    from osvl.expert.job import TrajConfig
    from osvl.models import tiny
    from osvl.sft.job import SftConfig

    before = config_hash(SftConfig()), config_hash(TrajConfig())
    assert C._hashed_dict(SftConfig())["tiny_kind"] == tiny.tiny_checkpoint("qwen3_vl").name
    assert yaml.safe_load(dump(SftConfig()))["tiny_kind"] == "qwen3_vl"  # the saved config keeps the name
    monkeypatch.setattr(tiny, "BPE_VOCAB", 2048)  # another tokenizer behind the same kind
    after = config_hash(SftConfig()), config_hash(TrajConfig())
    assert before[0] != after[0] and before[1] != after[1]
    with pytest.raises(ConfigError, match="unknown tiny model kind"):
        config_hash(SftConfig(tiny_kind="qwen9"))


def test_run_dir_saves_config(tmp_path):
    cfg = Job(run=RunConfig(root=str(tmp_path / "runs")), steps=4)
    path = run_dir(cfg, "toy")
    assert path == tmp_path / "runs" / "toy" / config_hash(cfg) and path.is_dir()
    text = (path / "config.yaml").read_text()
    assert text == dump(cfg) and text.startswith("run:\n  root: ")
    assert from_dict(Job, load_yaml(path / "config.yaml")) == cfg
    assert yaml.safe_load(text) == to_dict(cfg)
    assert run_dir(cfg, "toy") == path  # reruns find the same folder
    named = Job(run=RunConfig(root=str(tmp_path / "runs"), name="mine"))
    assert run_dir(named, "toy") == tmp_path / "runs" / "toy" / "mine"
    assert (tmp_path / "runs" / "toy" / "mine" / "config.yaml").is_file()


def test_to_dict_and_dump():
    d = to_dict(Job())
    assert list(d)[:4] == ["run", "model", "big", "lr"]
    assert d["model"] == {"hidden": 16, "dropout": 0.1, "act": "gelu", "cache": ""}
    text = dump(Job(lr=1e-6))
    assert yaml.safe_load(text)["lr"] == 1e-6 and text.index("model:") < text.index("lr:")


def test_input_paths_name_the_shared_data_folder_through_the_environment(monkeypatch, tmp_path):
    # under `ray job submit --working-dir .` nothing exists beside Ray's copy of the checkout: inputs name
    # the shared data folder as $OSVL_SHARED_DATA, which the job's environment sets
    monkeypatch.setenv("OSVL_SHARED_DATA", str(tmp_path / "data"))
    assert C.input_path("$OSVL_SHARED_DATA/mediawiki/x.xml.bz2") == tmp_path / "data" / "mediawiki" / "x.xml.bz2"
    assert C.input_path("${OSVL_SHARED_DATA}/images") == tmp_path / "data" / "images"
    assert C.input_path("/abs/file") == Path("/abs/file")
    assert C.input_path("configs") == C.REPO_ROOT / "configs"
    monkeypatch.delenv("OSVL_SHARED_DATA")
    # as named, not resolved: a checkout whose ../shared is a symbolic link gets the same path
    assert C.input_path("$OSVL_SHARED_DATA") == C.REPO_ROOT.parent / "shared" / "data"
    for path in list(C.CONFIG_DIR.rglob("*.yaml")) + list((C.REPO_ROOT / "jobs").glob("*.py")):
        assert "../shared" not in path.read_text(), path


def test_upstream_config_is_the_demo_profile_with_the_downstream_run_and_overrides(tmp_path):
    """What a job builds on (or reuses): the same folder as `jobs/<upstream>.py --run.root=R --run.seed=S ...`."""
    from osvl.config import upstream_config
    from osvl.synth.job import JOB, SynthConfig

    got = upstream_config(SynthConfig, JOB, RunConfig(root=str(tmp_path), seed=3, name="ignored"), {"num_shards": 5})
    want = C.parse_args(SynthConfig, JOB, [f"--run.root={tmp_path}", "--run.seed=3", "--num_shards=5"])
    assert got == want and C.config_hash(got) == C.config_hash(want) and got.run.name == ""


def test_script_flags_types_them_and_refuses_strays():
    """A bench's own flags take the type of their default; a bare flag sets a bool; the job's overrides come
    back for parse_args with rest=True, and without it a mistyped flag is an error, not ignored."""
    defaults = {"steps": 25, "scale": 5.0, "modes": "a,b", "scripted": False}
    flags, rest = script_flags(["--steps=3", "--scripted", "--rl.lr=1e-4", "--scale=0.5"], defaults, rest=True)
    assert flags == {"steps": 3, "scale": 0.5, "modes": "a,b", "scripted": True} and rest == ["--rl.lr=1e-4"]
    assert script_flags(["--scripted=false"], defaults)[0]["scripted"] is False
    with pytest.raises(ConfigError, match="unknown arguments.*--step=3"):
        script_flags(["--step=3"], defaults)
    with pytest.raises(ConfigError, match="--steps: 'x' is not int"):
        script_flags(["--steps=x"], defaults)


def test_a_renamed_key_says_what_it_was_renamed_to(tmp_path):
    """One name per concept across the configs (each config class's RENAMED): a flag or a profile of an earlier
    version fails at start with the key to write instead, not a guess from the close matches."""
    from osvl.recipe import GRPOJobConfig
    from osvl.sft.job import SftConfig

    with pytest.raises(ConfigError, match=r"^config key 'num_workers' was renamed to 'workers'$"):
        parse_args(SftConfig, "sft", ["--num_workers=1"])
    with pytest.raises(ConfigError, match=r"'warmup' was renamed to 'warmup_share'"):
        parse_args(SftConfig, "sft", ["--warmup=0.1"])
    old = tmp_path / "old.yaml"
    old.write_text("learner:\n  num_workers: 2\nsft:\n  num_workers: 1\n")
    with pytest.raises(ConfigError, match=r"'learner.num_workers' was renamed to 'learner.workers'"):
        parse_args(GRPOJobConfig, "grpo", [f"--profile={old}"])
    assert parse_args(SftConfig, "sft", ["--workers=1", "--warmup_share=0.1"]).workers == 1
    from osvl.agent.job import JOB, AskConfig

    with pytest.raises(ConfigError, match=r"'tool_names' was renamed to 'offer'"):
        parse_args(AskConfig, JOB, ["--tool_names=crop"])
    assert parse_args(AskConfig, JOB, []).offer == ["crop", "text_search"]  # the ask profile's
    # rollout and evaluation actors are workers too, episodes in flight a worker's concurrency
    old.write_text("rollout:\n  num_actors: 2\n")
    with pytest.raises(ConfigError, match=r"'rollout.num_actors' was renamed to 'rollout.workers'"):
        parse_args(GRPOJobConfig, "grpo", [f"--profile={old}"])
    with pytest.raises(ConfigError, match=r"'rollout.cpus_per_actor' was renamed to 'rollout.cpus_per_worker'"):
        parse_args(GRPOJobConfig, "grpo", ["--rollout.cpus_per_actor=2"])
    with pytest.raises(ConfigError, match=r"'synth.filter.concurrency' was renamed to 'synth.filter.workers'"):
        parse_args(GRPOJobConfig, "grpo", ["--synth.filter.concurrency=2"])
    from osvl.eval.job import EvalConfig

    with pytest.raises(ConfigError, match=r"^config key 'inflight' was renamed to 'concurrency'$"):
        parse_args(EvalConfig, "eval", ["--inflight=4"])
    assert parse_args(EvalConfig, "eval", ["--workers=2", "--concurrency=4"]).concurrency == 4
    # an old name is its own section's: `concurrency` is no old name of the SFT job's keys
    with pytest.raises(ConfigError, match=r"unknown config key 'concurrency'") as err:
        parse_args(SftConfig, "sft", ["--concurrency=2"])
    assert "renamed" not in str(err.value)
