"""GRPO checkpoints are complete only once marked (osvl/rl/checkpoint.py), without Ray or DeepSpeed.

A fake ``save_checkpoint`` writes DeepSpeed-shaped files (one set per rank) so that the layout can be
checked fast: ``latest`` takes only marked folders, the marker is written (and uploaded) after every
other file, pruning keeps the newest marked ones and removes incomplete ones, here and at a remote
run root (moto's S3 on loopback), and two ranks with separate node-local caches (two "nodes", gloo
between two processes) both get their shards to the bucket and both resume with every shard.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from osvl import storage
from osvl.rl import checkpoint as ckpt


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    storage._open.cache_clear()
    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OSVL_STORAGE_CACHE", raising=False)
    yield
    storage._open.cache_clear()


def _rank_files(rank: int) -> list[str]:
    return [f"ds/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            f"ds/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


def fake_save_checkpoint(engine, folder: Path, client_state: dict, processor=None) -> None:
    """What ``osvl.train.deepspeed.save_checkpoint`` leaves under ZeRO-3: each rank its shards, rank 0 the rest."""
    rank = engine.rank
    for rel in _rank_files(rank):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rank": rank, "client": client_state["step"]}, folder / rel)
    if rank == 0:
        (folder / "latest").write_text("ds")
        (folder / "hf").mkdir(exist_ok=True)
        (folder / "hf" / "model.safetensors").write_bytes(b"weights")


def _engine(rank: int = 0) -> SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return SimpleNamespace(module=model, optimizer=opt, rank=rank)


def _save(root: Path, step: int, rank: int = 0, world: int = 1, keep: int = 2, engine=None) -> Path:
    learner = SimpleNamespace(step_count=step, skipped=0)
    return ckpt.save(engine or _engine(rank), root, step, learner, None, None, rank, world, keep=keep)


@pytest.fixture
def fake_ds(monkeypatch):
    import osvl.train.deepspeed as ds

    monkeypatch.setattr(ds, "save_checkpoint", fake_save_checkpoint)
    monkeypatch.setattr(ckpt, "_buffer_state", lambda buffer: {"cursor": 7})


def _mark(path: Path, files: list[str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for rel in files:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text("x")
    (path / ckpt.MARKER).write_text(json.dumps({"step": int(re.sub(r"\D", "", path.name) or 0), "world": 1,
                                                      "files": files}))


def test_latest_takes_the_newest_marked_folder_only(tmp_path):
    root = tmp_path / "checkpoints"
    assert ckpt.latest(root) is None
    _mark(root / "step_000001", ["a"])
    _mark(root / "step_000002", ["a", "ds/b"])
    (root / "step_000003" / "ds").mkdir(parents=True)  # a save that died before its marker
    (root / "step_000003" / "ds" / "b").write_text("x")
    _mark(root / ".step_000004.tmp", ["a"])  # a staging folder, even with a marker
    _mark(root / "step_000005", ["a", "gone"])
    (root / "step_000005" / "gone").unlink()  # the marker lists a file that is not there: incomplete
    assert ckpt.latest(root) == root / "step_000002"
    assert ckpt.latest(root, fetch=True) == root / "step_000002"  # a local run root: nothing to pull


def test_owned_files_split_deepspeed_files_by_rank(tmp_path):
    for r in (0, 1, 12):
        _mark(tmp_path / "c", _rank_files(r))
    _mark(tmp_path / "c", ["latest", "ds/mp_rank_00_model_states.pt", "hf/model.safetensors", "buffer.pkl"])
    mine = {r: ckpt.owned_files(tmp_path / "c", r) for r in (0, 1, 12)}
    assert mine[1] == sorted(_rank_files(1)) and mine[12] == sorted(_rank_files(12))
    assert set(mine[0]) == {*_rank_files(0), "latest", "ds/mp_rank_00_model_states.pt",
                            "hf/model.safetensors", "buffer.pkl", ckpt.MARKER}


def test_prunable_keeps_the_newest_marked_and_drops_unmarked():
    names = ["step_000001", "step_000002", "step_000003", "step_000004", "step_000005", "other"]
    marked = {"step_000001", "step_000002", "step_000004"}
    # an unmarked folder newer than the checkpoint just marked may be the next one, still uploading: kept
    assert ckpt._prunable(names, marked, 2, "step_000004") == ["step_000001", "step_000003"]
    assert ckpt._prunable(names, marked, 0, "step_000004") == ["step_000003"]  # 0: keep all marked
    assert ckpt._prunable(names, marked, 1, "step_000002") == ["step_000001"]


def test_save_to_a_local_root_marks_last_renames_and_prunes(tmp_path, fake_ds, monkeypatch):
    root = tmp_path / "checkpoints"
    seen = []
    write = storage.atomic_write

    def spy(path, data):
        path = Path(path)
        if path.name == ckpt.MARKER:  # every file the marker vouches for is already written, not yet renamed
            listed = json.loads(data)["files"]
            seen.append(all((path.parent / rel).is_file() for rel in listed) and path.parent.name.endswith(".tmp")
                        and not (root / f"step_{json.loads(data)['step']:06d}").exists())
        write(path, data)

    monkeypatch.setattr(storage, "atomic_write", spy)
    (root / "step_000002").mkdir(parents=True)  # an unmarked leftover: removed by the next save
    (root / ".step_000003.tmp").mkdir()  # a staging folder of a save that died
    (root / ".step_000003.tmp" / "stale").write_text("x")
    for step in (1, 3, 4):
        final = _save(root, step)
        assert final == root / f"step_{step:06d}" and ckpt.is_complete(final)
    assert seen == [True, True, True]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    marker = json.loads((root / "step_000004" / ckpt.MARKER).read_text())
    assert marker["step"] == 4 and marker["world"] == 1
    assert set(marker["files"]) == {*_rank_files(0), "latest", "hf/model.safetensors", "buffer.pkl",
                                    "probe.json"}
    assert not (root / "step_000003" / "stale").exists()  # the dead save's staging did not leak into step 3
    assert ckpt.latest(root) == root / "step_000004"


def _bucket_files(uri: str) -> set[str]:
    import pyarrow.fs as pafs

    fs, path = storage.open_root(uri)
    return {i.path[len(path) + 1:] for i in fs.get_file_info(pafs.FileSelector(path, recursive=True,
                                                                                allow_not_found=True))
            if i.type.name == "File"}


def test_save_to_a_remote_root_uploads_marker_last_prunes_there_and_keeps_no_local_copy(
        s3_store, tmp_path, fake_ds, monkeypatch):
    uri = f"s3://{s3_store['bucket']}/ckpt-{tmp_path.name}/grpo/run"
    run = storage.mirror(uri)
    root = run / "checkpoints"
    # at the run root: an old complete checkpoint and an incomplete one that a dead run left
    for rel in ("step_000001/" + ckpt.MARKER, "step_000001/a", "step_000005/ds/x"):
        (tmp_path / "src").write_text(json.dumps({"step": 1, "world": 1, "files": ["a"]}))
        storage.upload(tmp_path / "src", storage.join(uri, "checkpoints", rel))
    uploads = []
    up = storage.upload

    def spy(local, where):
        uploads.append(where.rpartition("/checkpoints/")[2])
        up(local, where)

    monkeypatch.setattr(storage, "upload", spy)
    for step in (2, 3, 4):
        _save(root, step)
        ckpt.wait_uploads()
        assert not [p for p in root.iterdir() if p.is_dir()], "a node-local copy was kept"
        assert ckpt.latest(root) is None  # this node holds none ...
    mine = [u for u in uploads if u.startswith("step_000004/")]  # ... the run root holds step 4,
    assert len(mine) == 8 and mine[-2:] == [f"step_000004/{ckpt.RECEIPTS}/rank_0.json",
                                            f"step_000004/{ckpt.MARKER}"]  # its marker uploaded last
    files = _bucket_files(storage.join(uri, "checkpoints"))
    # steps 1 and 2 pruned; the dead 5 is newer than any step saved, so it could be one still uploading: it
    # stays, unmarked (never taken as a checkpoint), until the run saves step 5
    assert {f.split("/")[0] for f in files} == {"step_000003", "step_000004", "step_000005"}
    fs, path = storage.open_root(storage.join(uri, "checkpoints", "step_000004", ckpt.MARKER))
    with fs.open_input_stream(path) as f:
        marker = json.loads(f.read())
    assert {f"step_000004/{f}" for f in marker["files"]} | {f"step_000004/{ckpt.MARKER}",
                                                           f"step_000004/{ckpt.RECEIPTS}/rank_0.json"} == \
        {f for f in files if f.startswith("step_000004/")}

    # a resume on a node with no copy pulls the newest marked one whole
    shutil.rmtree(run)
    storage._open.cache_clear()
    root = storage.mirror(uri) / "checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    got = ckpt.latest(root, fetch=True)
    assert got == root / "step_000004" and ckpt.is_complete(got)
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    ckpt.drop_local(root)
    assert not [p for p in root.iterdir() if p.is_dir()]



def test_a_checkpoint_uploads_while_the_next_step_trains_and_counts_only_once_stored(
        s3_store, tmp_path, fake_ds, monkeypatch):
    """The learner saves (files staged), trains on while the files upload (every upload here takes 0.3 s), and
    the checkpoint is not the latest until its marker is stored after every file; a third save waits for room
    in the bounded queue instead of piling staged checkpoints up."""
    import time

    uri = f"s3://{s3_store['bucket']}/ckpt-bg-{tmp_path.name}/grpo/run"
    root = storage.mirror(uri) / "checkpoints"
    spans: list[tuple[str, float, float]] = []
    up = storage.upload

    def slow(local, where):
        t = time.monotonic()
        time.sleep(0.3)
        up(local, where)
        spans.append((where.rpartition("/checkpoints/")[2], t, time.monotonic()))

    monkeypatch.setattr(storage, "upload", slow)
    engine = _engine()
    t_save = time.monotonic()
    _save(root, 2, engine=engine)
    saved = time.monotonic()
    assert ckpt.latest(root, fetch=True) is None  # staged, uploading: not a checkpoint yet
    step_start = time.monotonic()  # the next learner step, on the same engine
    engine.module(torch.ones(4, 2)).sum().backward()
    engine.optimizer.step()
    step_end = time.monotonic()
    assert not storage.exists(storage.join(uri, "checkpoints", "step_000002", ckpt.MARKER))
    ckpt.wait_uploads()
    mine = [s for s in spans if s[0].startswith("step_000002/")]
    assert mine[-1][0] == f"step_000002/{ckpt.MARKER}" and len(mine) == 8
    assert saved - t_save < 0.3 < mine[-1][2] - t_save  # save returned before the first upload ended
    assert mine[0][1] < step_end and mine[-1][2] > step_start  # the uploads overlap the next step
    got = ckpt.latest(root, fetch=True)
    assert got == root / "step_000002" and ckpt.is_complete(got)

    spans.clear()
    _save(root, 3, engine=engine)  # taken by the uploader at once
    _save(root, 4, engine=engine)  # waits in the queue (room for one)
    t = time.monotonic()
    _save(root, 5, engine=engine)  # no room: returns once step 3 is stored and step 4 taken
    step3_marked = next(end for name, _, end in spans if name == f"step_000003/{ckpt.MARKER}")
    assert step3_marked <= time.monotonic() and step3_marked > t
    ckpt.wait_uploads()
    assert ckpt.latest(root, fetch=True) == root / "step_000005"

def _two_node_rank(rank: int, tmp: str, uri: str, errors) -> None:
    """One rank of two, on its own "node" (its own storage cache): save steps 1 and 2, then resume."""
    try:
        import torch.distributed as dist

        import osvl.train.deepspeed as ds

        os.environ["OSVL_STORAGE_CACHE"] = f"{tmp}/node{rank}"
        ds.save_checkpoint = fake_save_checkpoint
        ckpt._buffer_state = lambda buffer: {"cursor": 7}
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
        root = storage.mirror(uri) / "checkpoints"
        for step in (1, 2, 3):
            ckpt.save(_engine(rank), root, step, SimpleNamespace(step_count=step, skipped=0), None, None, rank, 2,
                      keep=2, local_rank=0)
            ckpt.wait_uploads()
            assert not [p for p in root.iterdir() if p.is_dir()], f"rank {rank} kept a node-local copy"
        got = ckpt.resume_point(root, rank, 0, 2)
        assert got == root / "step_000003" and ckpt.is_complete(got), got
        assert {f for f in _rank_files(0) + _rank_files(1) if (got / f).is_file()} == {*_rank_files(0),
                                                                                       *_rank_files(1)}
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {traceback.format_exc()}")


def _two_processes(target, args, timeout: float) -> None:
    """Run ``target(*args(rank, errors))`` as ranks 0 and 1 in spawned processes; fail with what they reported
    (a hang in a collective ends at ``timeout``)."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, errors)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs and all(p.exitcode == 0 for p in procs), "\n".join(msgs)


def test_two_ranks_on_two_nodes_store_every_shard_and_both_resume(s3_store, tmp_path):
    uri = f"s3://{s3_store['bucket']}/ckpt2-{tmp_path.name}/grpo/run"
    _two_processes(_two_node_rank, lambda r, errors: (r, str(tmp_path), uri, errors), timeout=120)
    files = _bucket_files(storage.join(uri, "checkpoints"))
    assert {f.split("/")[0] for f in files} == {"step_000002", "step_000003"}
    step3 = {f.removeprefix("step_000003/") for f in files if f.startswith("step_000003/")}
    assert {*_rank_files(0), *_rank_files(1), ckpt.MARKER, "buffer.pkl", "probe.json"} <= step3


def _zero3_rank(rank: int, port: int, tmp: str, uri: str, path: str, errors) -> None:
    """One real DeepSpeed ZeRO-3 rank of two, on its own "node" (its own storage cache): a step, a checkpoint to
    the bucket; then its node loses its cache, and a fresh engine resumes from the bucket alone."""
    try:
        import torch.distributed as dist

        from osvl.models.load import load_model, load_processor
        from osvl.rl.learner import RLConfig, make_engine

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank), OSVL_STORAGE_CACHE=f"{tmp}/node{rank}")
        torch.set_num_threads(1)
        ckpt._buffer_state = lambda buffer: {"cursor": 7}
        dist.init_process_group("gloo", rank=rank, world_size=2)
        processor = load_processor(path)
        cfg = RLConfig(lr=1e-3)

        def engine():
            return make_engine(load_model(path, dtype="float32"), cfg, zero_stage=3, world=2)

        def bare_mirror() -> Path:  # this node's mirror of the run folder, holding nothing yet
            local = storage.mirror_dir(uri)
            local.mkdir(parents=True, exist_ok=True)
            (local / storage.MARKER).write_text(uri)
            return local / "checkpoints"

        eng = engine()
        ids = torch.arange(10, 30 + 10 * rank).unsqueeze(0)
        eng.set_gradient_accumulation_boundary(True)  # as Learner.step does
        eng.backward(eng(input_ids=ids).logits.float().pow(2).mean())
        eng.step()
        root = bare_mirror()
        ckpt.save(eng, root, 1, SimpleNamespace(step_count=1, skipped=0), None, processor, rank, 2, keep=2,
                  local_rank=0)
        ckpt.wait_uploads()
        assert not [p for p in root.iterdir() if p.is_dir()], f"rank {rank} kept a node-local copy"
        dist.barrier()
        shutil.rmtree(f"{tmp}/node{rank}")  # every node-local cache is lost
        root = bare_mirror()
        fresh = engine()
        got = ckpt.resume_point(root, rank, 0, 2)
        assert got == root / "step_000001" and ckpt.is_complete(got), got
        client = ckpt.load_learner(fresh, got)
        assert client["step"] == 1 and len(client["rng"]) == 2
        ckpt.write_probe(fresh, Path(tmp) / f"resumed{rank}.json", client["version"])
        ckpt.write_probe(eng, Path(tmp) / f"saved{rank}.json", 1)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.slow  # two DeepSpeed processes: ~1 min on 2 shared cores
def test_zero3_ranks_on_two_nodes_checkpoint_to_the_bucket_and_resume_from_it(s3_store, tmp_path):
    """Real DeepSpeed ZeRO-3 files: each rank's shards reach the bucket from its own node, the marker lists them,
    and after every node-local cache is lost both ranks load the saved weights and Adam moments from it."""
    from osvl.cluster import free_port
    from osvl.models.tiny import tiny_checkpoint

    model = str(tiny_checkpoint("qwen3_vl"))  # built once, before two processes would race to build it
    uri = f"s3://{s3_store['bucket']}/zero3-{tmp_path.name}/grpo/run"
    port = free_port()
    _two_processes(_zero3_rank, lambda r, errors: (r, port, str(tmp_path), uri, model, errors), timeout=400)
    files = _bucket_files(storage.join(uri, "checkpoints"))
    fs, path = storage.open_root(storage.join(uri, "checkpoints", "step_000001", ckpt.MARKER))
    with fs.open_input_stream(path) as f:
        marker = json.loads(f.read())
    assert marker["world"] == 2 and {f"step_000001/{f}" for f in marker["files"]} | {
        f"step_000001/{ckpt.MARKER}"} | {f"step_000001/{ckpt.RECEIPTS}/rank_{r}.json" for r in (0, 1)} == files
    for rank in (0, 1):
        assert {f"step_000001/ds/zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                f"step_000001/ds/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"} <= files
        saved = json.loads((tmp_path / f"saved{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed{rank}.json").read_text())
        assert saved["exp_avg_abs_sum"] > 0 and resumed == saved  # this rank's partition, bit for bit
    assert "step_000001/hf/model.safetensors" in files and "step_000001/probe.json" in files
