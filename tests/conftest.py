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


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}  # dummy credentials; never the cloud metadata address


@pytest.fixture(scope="session")
def s3_store():
    """A real S3-compatible object store on loopback (moto's server mode) with one bucket, ``osvl-test``.

    Yields ``{"endpoint", "bucket", "env"}``; ``env`` holds the settings a client needs (endpoint,
    dummy credentials, ``AWS_EC2_METADATA_DISABLED=true``). They are also set in this process's
    environment for the session, so the storage layer and any Ray worker started here inherit them.
    """
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request

    from osvl.cluster import LOOPBACK, free_port

    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if server is None:
        pytest.skip("moto[server] is not installed")
    port = free_port()
    proc = subprocess.Popen([server, "-H", LOOPBACK, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://{LOOPBACK}:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto server did not come up on {endpoint}") from None
            time.sleep(0.3)
    env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/osvl-test", method="PUT"), timeout=10).close()
        yield {"endpoint": endpoint, "bucket": "osvl-test", "env": env}
    proc.terminate()
    proc.wait(timeout=15)
