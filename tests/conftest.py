"""Shared fixtures: one loopback-only Ray cluster per test session, started lazily."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("OSVL_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set OSVL_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that asks for it (starting one costs ~5 s)."""
    from osvl.cluster import init_ray

    ctx = init_ray(num_cpus=4, include_dashboard=False)
    yield ctx
    import ray

    ray.shutdown()
