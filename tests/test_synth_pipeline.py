"""The Ray Data pipeline: a killed run resumes to exactly the rows of an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_synth import make_kg  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cmd(kg: Path, name: str) -> list[str]:
    # every image degraded at 1200 px keeps each shard busy for a second or more, so the kill lands between shards
    return [sys.executable, str(REPO / "jobs" / "synthesize.py"), f"--kg_dir={kg}", f"--run.name={name}",
            "--num_shards=6", "--questions_per_seed=15", "--degrade.share=1.0", "--workers=1"]


def _rows(out: Path) -> list[dict]:
    rows = []
    for split in ("sft", "rl", "heldout"):
        rows += pq.read_table(out / f"{split}.parquet").to_pylist()
    return sorted(rows, key=lambda r: r["id"])


@pytest.mark.slow
def test_killed_run_resumes_to_the_rows_of_an_uninterrupted_run(tmp_path):
    kg = make_kg(tmp_path / "kg", image_size=1200)
    env = {**os.environ, "OSVL_RUN_ROOT": str(tmp_path / "runs")}
    root = tmp_path / "runs" / "synthesize"
    full = subprocess.run(_cmd(kg, "full"), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    expected = _rows(root / "full")
    assert len(expected) >= 100

    shards = root / "killed" / "shards"
    proc = subprocess.Popen(_cmd(kg, "killed"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(shards.glob("*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started (one session)
        proc.wait(30)
    done = sorted(p.name for p in shards.glob("*.parquet"))
    assert 1 <= len(done) < 6, f"kill landed outside the window: {done}"
    assert not (root / "killed" / "sft.parquet").exists()
    stamps = {name: (shards / name).stat().st_mtime_ns for name in done}

    rerun = subprocess.run(_cmd(kg, "killed"), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{len(done)} already done, {6 - len(done)} to run" in rerun.stdout
    assert _rows(root / "killed") == expected
    assert sorted(p.name for p in shards.glob("*.parquet")) == [f"shard-{k:05d}.parquet" for k in range(6)]
    assert {name: (shards / name).stat().st_mtime_ns for name in done} == stamps  # kept, not redone


STAGE = '''
import pyarrow as pa
import pyarrow.compute as pc


class KeepTwoHops:
    """Stands in for the difficulty filter: a callable class over pyarrow batches, as the slot expects."""

    def __init__(self, synth_cfg):
        assert synth_cfg.filter.stage == "keep_two:KeepTwoHops"  # the slot hands each stage the job's config

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch.filter(pc.equal(batch.column("hops"), 2))
'''


@pytest.mark.slow
def test_difficulty_filter_slot_runs_a_named_stage(tmp_path):
    import json

    kg = make_kg(tmp_path / "kg")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "keep_two.py").write_text(STAGE)
    env = {**os.environ, "OSVL_RUN_ROOT": str(tmp_path / "runs"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "stages"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(REPO / "jobs" / "synthesize.py"), f"--kg_dir={kg}", "--run.name=f",
           "--num_shards=2", "--questions_per_seed=20", "--filter.stage=keep_two:KeepTwoHops"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "synthesize" / "f")
    card = json.loads((tmp_path / "runs" / "synthesize" / "f" / "data_card.json").read_text())
    assert rows and {r["hops"] for r in rows} == {2}
    assert card["drops"]["difficulty_filter"]["rejected"] > len(rows) // 2
