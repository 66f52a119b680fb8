"""serve/config.yaml and its GPU overlay: valid for Serve's CLI, in sync with serve/app.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from osvl.config import from_dict

REPO = Path(__file__).resolve().parents[1]
TOOL_NAMES = ["crop", "sharpen", "super_resolution", "perspective_correct", "ocr", "text_search", "image_search"]


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "serve" / name).read_text())


@pytest.mark.parametrize("name", ["config.yaml", "config.gpu.yaml"])
def test_config_is_a_valid_serve_deploy_config_for_this_app(name):
    from ray.serve.schema import ServeDeploySchema

    from serve.app import APP_NAME, ServeConfig

    cfg = load(name)
    ServeDeploySchema.model_validate(cfg)  # what `serve deploy` / `serve run` check
    assert cfg["http_options"]["host"] == "127.0.0.1"
    (app,) = cfg["applications"]
    assert app["name"] == APP_NAME and app["import_path"] == "serve.app:build_app"
    args = from_dict(ServeConfig, app["args"])  # every key is a ServeConfig field of the right type
    assert set(args.batched) == {"super_resolution", "ocr"}
    names = [d["name"] for d in app["deployments"]]
    assert sorted(names) == sorted(["api"] + ["tool_" + t for t in TOOL_NAMES])
    for d in app["deployments"]:
        auto = d["autoscaling_config"]
        assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
        assert 0 < auto["target_ongoing_requests"] <= d["max_ongoing_requests"]
    cpus = sum(d["ray_actor_options"]["num_cpus"] * d["autoscaling_config"]["min_replicas"]
               for d in app["deployments"])
    assert cpus <= 2.0  # every tool starts on a 2-core laptop
    sr = next(d for d in app["deployments"] if d["name"] == "tool_super_resolution")
    assert sr["max_ongoing_requests"] >= args.max_batch_size  # a batch must be able to fill


def test_gpu_overlay_only_moves_edsr_to_a_gpu():
    cpu, gpu = load("config.yaml"), load("config.gpu.yaml")
    gpu_sr = next(d for d in gpu["applications"][0]["deployments"] if d["name"] == "tool_super_resolution")
    # a whole GPU per replica (replicas sharing one add no GPU compute), on tools nodes only
    assert gpu_sr["ray_actor_options"]["num_gpus"] == 1 and gpu_sr["ray_actor_options"]["resources"]["tools"] > 0
    for cfg in (cpu, gpu):  # drop what may differ, the rest must be equal
        app = cfg["applications"][0]
        app["args"].pop("max_batch_size")
        app["deployments"] = [d for d in app["deployments"] if d["name"] != "tool_super_resolution"]
    assert gpu == cpu
    assert not any("num_gpus" in d.get("ray_actor_options", {}) for d in copy.deepcopy(cpu)["applications"][0][
        "deployments"])


def test_an_inline_tool_cannot_also_be_batched():
    """An inline HTTP call runs in the ingress and would skip the tool replica's batch."""
    from osvl.errors import ConfigError
    from osvl.tools.registry import all_tools
    from serve.app import ServeConfig, make_app

    with pytest.raises(ConfigError, match="both inline and batched"):
        make_app(all_tools(), ServeConfig(tools=["crop", "sharpen"], batched=["sharpen"], inline=["crop", "sharpen"]))
    make_app(all_tools(), ServeConfig(tools=["crop"], batched=["sharpen"], inline=["crop"]))  # no overlap: fine


@pytest.mark.slow
@pytest.mark.parametrize("module, field", [("serve.app", "--max_pixels="), ("serve.agent_app", "--host="),
                                           ("serve.mcp_app", "--token_env=")])
def test_every_service_answers_help_with_its_fields(module, field):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: python -m {module}") and field in out.stdout, out.stdout[:2000]
