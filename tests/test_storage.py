"""The storage layer against a real S3-compatible store on loopback (moto's server): run folders mirror
to the bucket and come back after the node-local cache is deleted, Ray Train gets the bucket as its
storage, and a bad root fails at start with one line naming the setting, writing nothing."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest

from osvl import storage
from osvl.config import RunConfig, config_hash, opt, run_dir
from osvl.errors import StorageError


@dataclasses.dataclass
class Cfg:
    run: RunConfig = opt(RunConfig, "run")
    size: int = opt(3, "something that changes the output")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    storage._open.cache_clear()  # each test checks its roots under its own environment
    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    yield
    storage._open.cache_clear()


def _s3_files(store, prefix: str) -> set[str]:
    import pyarrow.fs as pafs

    fs, path = storage.open_root(f"s3://{store['bucket']}/{prefix}")
    return {i.path[len(path) + 1:] for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if i.type.name == "File"}


def test_a_run_folder_lives_in_the_bucket_and_survives_losing_the_local_cache(s3_store, tmp_path):
    root = f"s3://{s3_store['bucket']}/runs-roundtrip"
    cfg = Cfg(run=RunConfig(root=root))
    out = run_dir(cfg, "job")
    assert out.is_relative_to(tmp_path / "cache")  # a node-local mirror, not under the checkout
    (out / "shards").mkdir()
    (out / "shards" / "shard-00000.parquet").write_bytes(b"rows" * 100)
    (out / "shards" / "shard-00001.7.tmp").write_bytes(b"half")  # a file being written: never uploaded
    (out / "report.json").write_text('{"done": true}')
    storage.publish(out)
    h = config_hash(cfg)
    assert _s3_files(s3_store, f"runs-roundtrip/job/{h}") == {"config.yaml", "shards/shard-00000.parquet",
                                                              "report.json"}

    shutil.rmtree(tmp_path / "cache")  # the node-local cache is only a cache
    again = run_dir(Cfg(run=RunConfig(root=root)), "job")
    assert (again / "report.json").read_text() == '{"done": true}'
    assert (again / "shards" / "shard-00000.parquet").read_bytes() == b"rows" * 100
    # the hash does not depend on where the run is stored
    assert config_hash(Cfg(run=RunConfig(root=str(tmp_path / "local")))) == h
    assert not any(p.name == h for p in tmp_path.rglob("*") if not p.is_relative_to(tmp_path / "cache"))

    # publishing the whole pulled mirror uploads the changed file again and does not rewrite the unchanged one
    fs, path = storage.open_root(f"{root}/job/{h}")

    def mtimes() -> dict[str, int]:
        return {rel: fs.get_file_info(f"{path}/{rel}").mtime_ns
                for rel in ("report.json", "shards/shard-00000.parquet")}

    first = mtimes()
    time.sleep(1.1)  # S3's Last-Modified has one-second resolution
    (again / "report.json").write_text('{"done": "twice"}')
    storage.publish(again)
    now = mtimes()
    assert now["report.json"] > first["report.json"]  # the probe does see a rewrite
    assert now["shards/shard-00000.parquet"] == first["shards/shard-00000.parquet"]
    shutil.rmtree(tmp_path / "cache")
    assert (run_dir(Cfg(run=RunConfig(root=root)), "job") / "report.json").read_text() == '{"done": "twice"}'


def test_ray_train_gets_the_bucket_as_its_storage(s3_store):
    import pyarrow.fs as pafs

    out = run_dir(Cfg(run=RunConfig(root=f"s3://{s3_store['bucket']}/runs-train")), "sft")
    path, fs = storage.train_storage(out)
    assert isinstance(fs, pafs.S3FileSystem)
    assert path == f"{s3_store['bucket']}/runs-train/sft/{out.name}"
    local = run_dir(Cfg(run=RunConfig(root=str(Path.cwd() / "runs"))), "sft")
    assert storage.train_storage(local) == (str(local.resolve()), None)


@pytest.mark.parametrize(("root", "env", "says"), [
    ("ftp://host/runs", {}, "unknown scheme 'ftp'"),
    ("s3://osvl-test/runs", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "not reachable"),
    ("s3://osvl-test/runs", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "",
                             "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"},
     "no S3 credentials"),
    ("s3://no-such-bucket/runs", {}, "bucket 'no-such-bucket' does not exist"),
])
def test_a_bad_root_fails_at_start_naming_the_setting_and_writes_nothing(s3_store, tmp_path, monkeypatch,
                                                                          root, env, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StorageError) as err:
        run_dir(Cfg(run=RunConfig(root=root)), "job")
    msg = str(err.value)
    assert msg.startswith(f"run.root={root}: ") and says in msg and "\n" not in msg
    assert not any(os.scandir(tmp_path / "cache")) if (tmp_path / "cache").exists() else True
    assert not [p for p in tmp_path.iterdir() if p.name != "cache"]  # no "ftp:" or "s3:" folder in the cwd


_PULLER = """
import json, sys, hashlib
from pathlib import Path
from osvl import storage

def status_mb(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024

uri, local, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
storage.open_root(uri)  # the S3 client and its threads: there before the pull, not counted in its growth
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the resident set now
before = status_mb("VmRSS")
storage.pull(uri, local)
peak = status_mb("VmHWM")
digest = hashlib.sha256()
with open(local / name, "rb") as f:
    while chunk := f.read(1 << 20):
        digest.update(chunk)
print(json.dumps({"growth_mb": peak - before, "sha256": digest.hexdigest()}))
"""


@pytest.mark.slow
def test_a_large_object_pulled_by_four_processes_streams_and_is_never_seen_partial(s3_store, tmp_path):
    """A 256 MB object, four processes of one node pulling the same mirror at once: each grows by at most 64 MB
    (the pull streams in chunks), all read the same bytes, and the file is either absent or whole whenever looked
    at (streamed into a temporary file, renamed into place)."""
    import hashlib
    import json
    import subprocess
    import sys
    import threading

    import numpy as np

    size, name = 256 << 20, "big.bin"
    uri = f"s3://{s3_store['bucket']}/large-pull"
    fs, path = storage.open_root(uri)
    digest, rng = hashlib.sha256(), np.random.default_rng(0)
    with fs.open_output_stream(f"{path}/{name}") as out:
        for _ in range(size // (8 << 20)):
            chunk = rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
            digest.update(chunk)
            out.write(chunk)
    local = tmp_path / "mirror"
    seen_sizes: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                seen_sizes.add((local / name).stat().st_size)
            except FileNotFoundError:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    procs = [subprocess.Popen([sys.executable, "-c", _PULLER, uri, str(local), name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    done.set()
    watcher.join(timeout=10)
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    print(json.dumps([round(g["growth_mb"], 1) for g in got]))
    assert {g["sha256"] for g in got} == {digest.hexdigest()}
    assert all(g["growth_mb"] <= 64 for g in got), got
    assert seen_sizes == {size}, sorted(seen_sizes)[:5]  # looked at while being pulled: only ever whole
    assert not [p.name for p in local.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_publishing_one_image_appends_to_the_sync_ledger_whatever_its_size(s3_store, tmp_path):
    """The sync ledger is append-only: with 100,000 entries, publishing one more image appends at most 1 KB and
    takes at most 2x as long as with 1,000 (a process that has read the ledger once, as a rollout actor has,
    reads only what was appended since); and a pull after it knows that image is current."""
    import json
    import statistics

    def timed_publishes(entries: int) -> tuple[list[float], list[int]]:
        uri = f"s3://{s3_store['bucket']}/ledger-{entries}"
        folder = storage.mirror(uri)
        (folder / "images").mkdir()
        with open(folder / storage.SYNCED, "w") as f:  # what a long run's publishes leave behind
            for i in range(entries // 2):
                f.write(json.dumps([f"images/old-{i:06d}.png", [1000, 1_700_000_000_000_000_000 + i]]) + "\n")
                f.write(json.dumps([f"@images/old-{i:06d}.png", [1000, 1_700_000_000_000_000_000 + i]]) + "\n")
        seconds, grew = [], []
        for k in range(11):
            (folder / "images" / f"new-{k}.png").write_bytes(os.urandom(2000))
            size = (folder / storage.SYNCED).stat().st_size
            t0 = time.perf_counter()
            storage.publish(folder, f"images/new-{k}.png")
            seconds.append(time.perf_counter() - t0)
            grew.append((folder / storage.SYNCED).stat().st_size - size)
        return seconds[1:], grew  # the first publish of this process reads the whole ledger once

    small, small_grew = timed_publishes(1_000)
    large, large_grew = timed_publishes(100_000)
    print(json.dumps({"median_s_1k": statistics.median(small), "median_s_100k": statistics.median(large),
                      "bytes_appended": large_grew}))
    assert max(large_grew) <= 1024 and min(large_grew) > 0 and max(small_grew) <= 1024
    assert statistics.median(large) <= 2 * statistics.median(small), (small, large)
    folder = storage.mirror(f"s3://{s3_store['bucket']}/ledger-100000")
    assert storage._synced(folder)["images/new-10.png"][0] == 2000  # the ledger still reads whole


@pytest.mark.slow
def test_a_learner_step_fetches_its_images_by_name_without_listing(s3_store, tmp_path, monkeypatch):
    """Images a rollout actor published from another node reach the learner's mirror by name (one HEAD and one GET
    each, in moto's request log) and no LIST request: the learner step's call (``storage.fetch``, as
    ``osvl.rl.learner_loop`` makes it). The old way (``refresh``) lists the prefix; the log shows that too."""
    import json
    import urllib.request

    uri = f"s3://{s3_store['bucket']}/fetch-run/images"
    actor = storage.mirror(uri)  # the rollout actor's node
    names = [f"{i:02d}.png" for i in range(3)]
    for name in names + ["other.png"]:
        (actor / name).write_bytes(os.urandom(500))
    storage.publish(actor)
    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "learner-node"))  # the learner's node: an empty cache
    learner = storage.mirror_dir(uri)
    learner.mkdir(parents=True)
    (learner / storage.MARKER).write_text(uri)

    def recorded(action) -> list[dict]:
        api = f"{s3_store['endpoint']}/moto-api/recorder"
        urllib.request.urlopen(urllib.request.Request(f"{api}/reset-recording", method="POST"), timeout=10).close()
        urllib.request.urlopen(urllib.request.Request(f"{api}/start-recording", method="POST"), timeout=10).close()
        try:
            action()
        finally:
            urllib.request.urlopen(urllib.request.Request(f"{api}/stop-recording", method="POST"), timeout=10).close()
        text = s3_store["recording"].read_text() if s3_store["recording"].exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    def listing(req: dict) -> bool:
        query = req["url"].partition("?")[2]
        return req["method"] == "GET" and ("list-type" in query or "prefix=" in query or "delimiter" in query)

    got = recorded(lambda: storage.fetch(learner, names))
    assert [(learner / n).read_bytes() for n in names] == [(actor / n).read_bytes() for n in names]
    assert not (learner / "other.png").exists()
    assert got and not [r["url"] for r in got if listing(r)], [r["url"] for r in got]
    assert sum(r["method"] == "GET" for r in got) == 3  # one GET per image, HEADs aside
    assert recorded(lambda: storage.fetch(learner, names)) == []  # all here: no request at all
    assert any(listing(r) for r in recorded(lambda: storage.refresh(learner)))  # the test can see a LIST
