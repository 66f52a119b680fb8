"""The cluster launcher config and KubeRay manifests are valid for the tools that read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_cluster_yaml_matches_ray_autoscaler_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    jsonschema.validate(cfg, schema)
    assert cfg["head_node_type"] in cfg["available_node_types"]
    # every role the jobs schedule on has a node type that offers it
    offered = {r for t in cfg["available_node_types"].values() for r in t.get("resources", {})}
    assert {"learner", "rollout", "tools", "data"} <= offered
    starts = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in starts


def test_kuberay_manifests_parse():
    docs = []
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "RayJob", "RayService"} <= kinds
    for d in docs:
        assert d["apiVersion"].startswith("ray.io/"), d["apiVersion"]
