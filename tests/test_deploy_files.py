"""The cluster launcher config and KubeRay manifests are valid for the tools that read them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = {p.name: _docs(p)[0] for p in sorted((REPO / "deploy").glob("ray*.yaml"))}
CLUSTER_CONFIGS = [REPO / "cluster.yaml", REPO / "deploy" / "cluster-local.yaml"]


def _cluster_spec(doc: dict) -> dict:
    return {"RayCluster": lambda d: d["spec"], "RayJob": lambda d: d["spec"]["rayClusterSpec"],
            "RayService": lambda d: d["spec"]["rayClusterConfig"]}[doc["kind"]](doc)


def _groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def _group_roles(group: dict) -> dict[str, float]:
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}  # KubeRay's format: a quoted JSON object


def _dockerfile() -> tuple[list[str], dict[str, str]]:
    """Dockerfile instructions (continuations joined) and its ENV/ARG values."""
    lines, cur = [], ""
    for raw in (REPO / "deploy" / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        cur += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(cur.strip())
            cur = ""
    values = {}
    for line in lines:
        if line.startswith(("ENV ", "ARG ")):
            for m in re.finditer(r'(\w+)=("[^"]*"|\S+)', line[4:]):
                values[m.group(1)] = m.group(2).strip('"')
    return lines, values


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_configs_match_ray_autoscaler_schema(path):
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, schema)
    # the laptop's environments, runs and caches stay behind; the checkout's own ignores apply too
    assert {".venv", ".venv-vllm", "runs"} <= set(cfg["rsync_exclude"]) and cfg["rsync_filter"] == [".gitignore"]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in cfg[key]:  # the venv first on PATH in every start command, so jobs' `python` is the venv's
            assert re.match(r"export PATH=\S*/(\.venv|venv)/bin:\$PATH[ ;]", cmd), cmd
        start = next(c for c in cfg[key] if "ray start" in c)
        assert "RAY_AUTH_MODE=token" in start  # GCS listens beyond loopback: token auth stays on
        assert "--metrics-export-port=" in start
    head = next(c for c in cfg["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=127.0.0.1" in head
    assert "~/.ray/auth_token" in cfg["file_mounts"].values()  # one token for the nodes and the submitter
    setup = " ".join(cfg.get("setup_commands", []))
    assert ".[gpu]" not in setup and "[dev]" not in setup


def test_cluster_yaml_runs_the_image_with_roles_storage_and_boto3():
    from osvl.cluster import ROLE_RESOURCES

    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    image = cfg["docker"]["image"]
    assert image == _image(), "cluster.yaml and the KubeRay manifests run one image"
    offered = {r for t in cfg["available_node_types"].values() for r in t.get("resources", {}) if r != "CPU"}
    assert offered == set(ROLE_RESOURCES.values())
    for cmd in cfg["head_start_ray_commands"][1:] + cfg["worker_start_ray_commands"][1:]:
        assert re.search(r"OSVL_RUN_ROOT=(s3|gs|abfs)://", cmd), cmd
    lines, values = _dockerfile()
    assert "boto3" in values.get("BOTO3_SPEC", ""), "the autoscaler on the head needs boto3"


def test_every_command_and_path_of_cluster_yaml_exists_in_the_image_or_repo():
    """Executables are the image's venv (Dockerfile ENV VENV) or what its pinned packages install; paths under
    the synced checkout exist in the repo."""
    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    lines, values = _dockerfile()
    venv = values["VENV"]
    mount = next(k for k, v in cfg["file_mounts"].items() if v == ".")
    commands = cfg["setup_commands"] + cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    text = " ".join(commands)
    for path in set(re.findall(r"(/[\w./-]+)", text)):
        if path.startswith(venv + "/bin"):
            assert path in (f"{venv}/bin", f"{venv}/bin/pip", f"{venv}/bin/python"), path
        elif path.startswith(mount):
            assert (REPO / path.removeprefix(mount).lstrip("/")).exists(), path
    for cmd in commands:  # after the PATH export, `ray` is the venv's: Ray is a pinned dependency
        for exe in re.findall(r"(?:^|; )(?:ulimit [^;]+; )?(\w+) ", cmd.split("$PATH", 1)[-1]):
            assert exe in {"ray", "ulimit"}, exe
    pins = (REPO / "constraints.txt").read_text()
    assert re.search(r"^ray==", pins, re.M)
    # the comments' commands name real files
    for ref in re.findall(r"(jobs/\w+\.py|deploy/[\w.-]+)", (REPO / "cluster.yaml").read_text()):
        assert (REPO / ref).exists(), ref


def test_dockerfile_installs_dependencies_before_copying_the_code():
    lines, values = _dockerfile()
    copies = [i for i, line in enumerate(lines) if line.startswith("COPY")]
    code = next(i for i in copies if re.search(r"COPY (--chown=\S+ )?\. ", lines[i]))
    deps = next(i for i, line in enumerate(lines) if "constraints.txt -r" in line)
    assert deps < code, "the dependency layer must come before the code is copied"
    for i in copies:
        if i != code:  # before the code: only the files that name dependencies
            files = lines[i].split()[1:-1]
            assert all(f.startswith("--") or f in ("pyproject.toml", "constraints.txt", "requirements-vllm.txt")
                       for f in files), lines[i]
    text = " ".join(lines)
    assert "[dev]" not in text and "[gpu]" not in text
    base = next(line for line in lines if line.startswith("FROM"))
    assert "py311" in base and "cu128" in base and "cu128" in values["TORCH_SPEC"]  # Python 3.11, torch's CUDA
    assert "vllm==" in values["VLLM_SPEC"] and "$VLLM_VENV/bin/pip install" in text
    assert values["TORCH_SPEC"].startswith("torch==2.13.0")
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".venv-vllm", "runs", ".git"} <= set(ignored)


def _image() -> str:
    images = {c["image"] for d in MANIFESTS.values() for g in _groups(_cluster_spec(d))
              for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1, images
    return images.pop()


def test_kuberay_manifests_image_auth_and_dashboard():
    kinds = {d["kind"] for d in MANIFESTS.values()}
    assert kinds == {"RayCluster", "RayJob", "RayService"}
    image = _image()
    registry, _, rest = image.rpartition("/")
    name, _, tag = rest.partition(":")
    assert registry and name == "osvl" and re.fullmatch(r"\d+\.\d+\.\d+", tag), image  # pinned, not latest
    for doc in MANIFESTS.values():
        assert doc["apiVersion"] == "ray.io/v1"
        spec = _cluster_spec(doc)
        assert spec["authOptions"] == {"mode": "token"}, doc["kind"]
        head = spec["headGroupSpec"]["rayStartParams"]
        # the operator and the job submitter reach <head-svc>:8265; token auth guards it
        assert head["dashboard-host"] == "0.0.0.0", doc["kind"]


def test_kuberay_group_resources_are_the_code_roles():
    from osvl.cluster import ROLE_RESOURCES

    for doc in MANIFESTS.values():
        for group in _cluster_spec(doc).get("workerGroupSpecs", []):
            roles = _group_roles(group)
            assert roles and set(roles) <= set(ROLE_RESOURCES.values()), (doc["kind"], group["groupName"])
            gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
            if set(roles) & {"learner", "rollout"}:
                assert gpus >= max(roles.values()), group["groupName"]  # one role slot per GPU


def test_rayjob_entrypoint_parses_as_the_grpo_job_with_storage_on_a_uri():
    import shlex

    from osvl.config import parse_args
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB

    doc = MANIFESTS["rayjob-grpo.yaml"]
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[0] == "python" and (REPO / argv[1]).is_file() and argv[1] == "jobs/grpo.py"
    cfg = parse_args(GRPOJobConfig, JOB, argv[2:])
    assert re.match(r"(s3|gs|abfs)://", cfg.run.root), cfg.run.root
    groups = {tuple(_group_roles(g)): g for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    learner_gpus = sum(int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                       * g["replicas"] for k, g in groups.items() if "learner" in k)
    assert learner_gpus >= cfg.learner.workers  # the production profile's learner fits its group
    assert any("rollout" in k for k in groups) and any("tools" in k for k in groups)


def test_rayservice_builds_the_app_the_client_and_serve_configs_name(monkeypatch):
    """The import path is an object that builds the app; one app name; the GPU Serve config, unchanged."""
    import importlib

    from osvl.tools.client import HandleTransport
    from osvl.tools.registry import all_tools
    from serve.app import APP_NAME, ServeConfig, make_app

    doc = MANIFESTS["rayservice-tools.yaml"]
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    gpu = yaml.safe_load((REPO / "serve" / "config.gpu.yaml").read_text())
    cpu = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    assert serve_cfg["applications"] == gpu["applications"]
    (app,) = serve_cfg["applications"]
    assert app["name"] == APP_NAME == gpu["applications"][0]["name"] == cpu["applications"][0]["name"]
    assert HandleTransport().app_name == APP_NAME
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    monkeypatch.setenv(app["args"]["token_env"], "test-token")
    from ray import serve

    assert isinstance(builder(app["args"]), serve.Application)
    # every deployment the manifest configures exists in the app (make_app refuses unknown names)
    from osvl.config import from_dict

    deployments = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in app["deployments"]}
    make_app(all_tools(), from_dict(ServeConfig, app["args"]), deployments)
    # the proxy listens beyond loopback here: every pod has the tool API's token from a Secret
    assert serve_cfg["http_options"]["host"] == "0.0.0.0"
    for group in _groups(_cluster_spec(doc)):
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0].get("env", [])}
        assert "secretKeyRef" in env[app["args"]["token_env"]]["valueFrom"]
    gpu_deps = [d for d in app["deployments"] if d.get("ray_actor_options", {}).get("num_gpus")]
    tools = [g for g in _cluster_spec(doc)["workerGroupSpecs"] if "tools" in _group_roles(g)]
    assert gpu_deps and tools and all(
        int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1 for g in tools)


_BUILD = """
import sys
from serve.app import build_app
from osvl.errors import ConfigError
try:
    app = build_app({"tools": ["crop"]})
except ConfigError as e:
    print(e)
    sys.exit(2)
print("built", type(app).__name__)
"""


@pytest.mark.slow  # two fresh interpreters importing Ray Serve (~4 s each)
def test_every_tools_group_offers_the_gpus_edsr_scales_to():
    """EDSR's replicas take a whole GPU each on tools nodes (serve/config.gpu.yaml): each cluster definition's tools
    nodes, at their most, hold max_replicas of them; other nodes' GPUs do not count (the replicas never go there)."""
    from osvl.rl.plan import read_cluster

    app = yaml.safe_load((REPO / "serve" / "config.gpu.yaml").read_text())["applications"][0]
    sr = next(d for d in app["deployments"] if d["name"] == "tool_super_resolution")
    need = sr["autoscaling_config"]["max_replicas"] * sr["ray_actor_options"]["num_gpus"]
    assert sr["ray_actor_options"]["resources"]["tools"] > 0
    offers = {}
    doc = yaml.safe_load((REPO / "cluster.yaml").read_text())
    types = {t.name: t for t in read_cluster(REPO / "cluster.yaml")}
    offers["cluster.yaml"] = sum(types[n].gpus * spec.get("max_workers", 0)
                                 for n, spec in doc["available_node_types"].items() if "tools" in types[n].resources)
    for name, manifest in MANIFESTS.items():
        groups = [g for g in _groups(_cluster_spec(manifest)) if "tools" in _group_roles(g)]
        if groups:
            offers[name] = sum(int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                               * int(g.get("maxReplicas", g.get("replicas", 1))) for g in groups)
    assert len(offers) == 4 and all(v >= need for v in offers.values()), (need, offers)


def test_tool_api_refuses_a_non_loopback_host_without_token():
    """Serve's proxy on 0.0.0.0 (what a RayService runs): no token, one clear line; with a token, the app builds.

    Nothing binds here: the builder reads the host Serve would use and refuses before any deployment.
    """
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OSVL_TOOLS_TOKEN"}
    env.update(RAY_SERVE_DEFAULT_HTTP_HOST="0.0.0.0", PYTHONPATH=str(REPO))
    refused = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stdout.strip()
    assert "\n" not in line and line.startswith("refusing to serve the tool API on 0.0.0.0 without a bearer token")
    assert "OSVL_TOOLS_TOKEN" in line
    env["OSVL_TOOLS_TOKEN"] = "s3cret"
    built = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0 and built.stdout.strip().startswith("built"), built.stderr[-2000:]


def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run bench/gpu_check.sh itself")
    proc = subprocess.run([str(REPO / "bench" / "gpu_check.sh")], env={**__import__("os").environ,
                          "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"gpu_check: skipped: no CUDA GPU visible to {sys.executable} "
                                   "(torch.cuda.is_available() is False)")
