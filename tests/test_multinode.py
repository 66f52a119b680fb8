"""The main job on a real multi-node Ray cluster with its run root in an S3-compatible bucket.

``ray job submit --working-dir . -- python jobs/grpo.py --run.root=s3://...`` at test sizes
(questions -> trajectories -> SFT -> GRPO -> held-out evaluation), while one rollout node is
killed in the middle of GRPO; then the node-local caches are deleted and the same command is
submitted again with one more GRPO step. The GRPO learner is two Ray Train workers under ZeRO-3,
one on node "a" and one on a learner-only node "c" that the test adds (each offers one unit of the
``learner`` resource, and each worker asks for one), so each rank's shard is written on its own node.
Checked: the job finishes every step on the surviving nodes, every issued group is trained once or
dropped with a reason, every stage's outputs and checkpoints are in the bucket and nowhere else
(each learner rank's shard files and the checkpoint's completion marker included; the learner nodes
keep no copy of a checkpoint), where Ray's state API says each role ran, and that the resubmission
recomputes nothing, continues from the last GRPO checkpoint with the weights and Adam moments it
saved (the resume probe), and trains only the new step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# node b is killed once step 1 is logged: two more steps show the job going on without it (synchronous,
# max_staleness 0, so that step 2 waits for fresh rollouts instead of groups generated before the kill)
STEPS = 3
JOBS = ("synthesize", "trajectories", "sft", "grpo")
# two learner ranks under ZeRO-3 (each writes its own shard files), one per learner node
LEARNERS = ["--learner.workers=2", "--learner.zero_stage=3"]
CKPT = "grpo/e2e/checkpoints"


def grpo_args(root: str) -> list[str]:
    """The smallest sizes the chain runs at (README "Running on a cluster" shows the same command)."""
    return [f"--run.root={root}", "--run.name=e2e",
            "--synth.questions_per_seed=2", "--synth.num_shards=1", "--synth.workers=1", "--synth.role_units=1",
            "--trajectories.max_questions=4", "--trajectories.shard_size=4", "--trajectories.workers=1",
            "--trajectories.role_units=1", "--trajectories.n_teacher_rollouts=1", "--sft.max_steps=2",
            "--sft.max_len=1024", "--sft.workers=1", "--sft.data.n_eval=0",
            "--rl.group_size=2", "--rl.max_len=2048", f"--train.steps={STEPS}", "--train.groups_per_step=2",
            "--train.ckpt_every=1", "--train.max_staleness=0", "--rollout.workers=2", "--rollout.num_gpus=0.5",
            "--rollout.role_units=1", "--rollout.agent.max_turns=2", "--rollout.agent.max_new_tokens=32",
            "--rollout.agent.max_episode_tokens=2048", "--learner.role_units=1", *LEARNERS, "--eval.n_heldout=1",
            "--eval.concurrency=1"]


def _submit(cluster: dict, root: str, steps: int = STEPS) -> tuple[subprocess.Popen, list[str]]:
    """Start ``ray job submit`` (``steps`` GRPO steps); its output lines, each prefixed
    with seconds since submission, fill the list (printed when the test ends: where the time goes, stage by
    stage)."""
    import threading

    args = [a for a in grpo_args(root) if not a.startswith("--train.steps=")] + [f"--train.steps={steps}"]
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster["address"],
           "--working-dir", ".", "--", "python", "jobs/grpo.py", *args]
    job = subprocess.Popen(cmd, cwd=REPO, env=cluster["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    lines: list[str] = []
    t0 = time.time()

    def pump() -> None:
        for line in job.stdout:
            lines.append(f"{time.time() - t0:7.1f} {line.rstrip()}")

    threading.Thread(target=pump, daemon=True).start()
    return job, lines


def _bucket(root: str) -> tuple[object, str]:
    from osvl import storage

    return storage.open_root(root)


def _files(root: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, path = _bucket(root)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return [i.path[len(path) + 1:] for i in infos if i.type.name == "File"]


def _read(root: str, rel: str) -> str:
    fs, path = _bucket(root)
    with fs.open_input_stream(f"{path}/{rel}") as f:
        return f.read().decode()


def _add_learner_node(cluster: dict, name: str = "c") -> tuple[Path, Path]:
    """Join a node that offers one unit of ``learner`` and one CPU (no GPU, no other role) to the fixture's
    cluster, as the fixture joins its nodes; returns its temp dir and its node-local storage cache."""
    import json as _json

    from osvl.cluster import ROLE_RESOURCES, free_port
    from osvl.cluster import stop_node as _stop

    base = cluster["temp_dirs"]["head"].parent
    temp_dir, cache = base / f"node-{name}", base / f"{name}-cache"
    gcs = (cluster["temp_dirs"]["head"] / "ray_current_cluster").read_text().strip()  # written by `ray start`
    env = {**cluster["env"], "OSVL_STORAGE_CACHE": str(cache), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
             "--metrics-export-port", "--node-manager-port", "--object-manager-port"]
    for _ in range(2):  # a free port can be taken before Ray binds it
        cmd = [str(Path(sys.executable).parent / "ray"), "start", f"--address={gcs}", "--node-ip-address=127.0.0.5",
               f"--temp-dir={temp_dir}", "--disable-usage-stats", *(f"{p}={free_port()}" for p in ports),
               "--num-cpus=1", "--num-gpus=0", f"--resources={_json.dumps({ROLE_RESOURCES['learner']: 1})}"]
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        if done.returncode == 0:
            break
        _stop(str(temp_dir))
    else:
        raise RuntimeError(f"ray start of node {name} failed: {done.stderr[-3000:]}")
    deadline = time.time() + 120
    while not any(n.node_ip == "127.0.0.5" and n.state == "ALIVE" for n in cluster["state"]("nodes")):
        assert time.time() < deadline, f"node {name} did not join"
        time.sleep(1)
    return temp_dir, cache


def _checkpoint_copies(cache: Path) -> list[Path]:
    """Checkpoint files a node keeps in its storage cache: DeepSpeed shards, or anything in a GRPO checkpoint."""
    return [p for p in cache.rglob("*") if p.is_file()
            and ("zero_pp_rank_" in p.name or re.search(r"/checkpoints/\.?step_\d+", p.as_posix()))]


def _rank_shards(files: list[str], step: int, rank: int) -> list[str]:
    pattern = re.compile(rf"{CKPT}/step_{step:06d}/ds/(bf16_)?zero_pp_rank_{rank}_mp_rank_00_"
                         r"(model|optim)_states\.pt")
    return sorted(f for f in files if pattern.fullmatch(f))


def _run_folders(top: Path) -> list[Path]:
    """``<job>/<config hash or run name>`` folders under ``top`` (two levels below any folder named like a job)."""
    found = []
    for job in JOBS:
        for d in top.rglob(job):
            if d.is_dir():
                found += [p for p in d.iterdir() if p.is_dir() and (len(p.name) == 12 or p.name == "e2e")]
    return found


def _local_run_folders(cluster: dict) -> list[Path]:
    """Run folders outside the bucket: in the checkout, the nodes' temp dirs (Ray's working-dir cache), /tmp."""
    found = _run_folders(REPO) + [p for t in cluster["temp_dirs"].values() for p in _run_folders(t)]
    return found + [p for p in Path("/tmp").glob("*/*") if p.parent.name in JOBS]


def test_readme_shows_the_command_this_test_submits():
    import re

    text = (REPO / "README.md").read_text().split("## Running on a cluster\n")[1].split("\n## ")[0]
    flat = re.sub(r" \\\n\s*", " ", text)
    assert "--working-dir . -- python jobs/grpo.py " + " ".join(grpo_args("s3://BUCKET/runs")) in flat


def _listening_ips(temp_dirs: list[Path]) -> set[str]:
    """Addresses the processes of these Ray nodes listen on."""
    import psutil

    pids = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(t) in " ".join(proc.info["cmdline"] or []) for t in temp_dirs):
                pids |= {proc.pid} | {c.pid for c in proc.children(recursive=True)}
        except psutil.Error:
            continue
    return {c.laddr.ip for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_grpo_job_on_a_multinode_cluster_with_s3_storage(multinode_cluster, s3_store):
    from osvl.cluster import stop_node

    cluster = multinode_cluster
    node_c, cache_c = _add_learner_node(cluster)
    try:
        _grpo_job_on_a_multinode_cluster(cluster, s3_store, node_c, cache_c)
    finally:
        stop_node(str(node_c))


def _grpo_job_on_a_multinode_cluster(cluster: dict, s3_store: dict, node_c: Path, cache_c: Path) -> None:
    from osvl.cluster import stop_node

    root = f"s3://{s3_store['bucket']}/runs-{uuid.uuid4().hex[:8]}"
    before = set(_local_run_folders(cluster))  # e.g. `make demo`'s under runs/: not this job's
    t0 = time.time()
    job, lines = _submit(cluster, root)
    # kill rollout node "b" (its own processes only) once GRPO has trained a step
    killed_at = None
    deadline = time.time() + 1200
    fs, path = _bucket(root)
    while job.poll() is None and time.time() < deadline:
        # one request for the step log (learner rank 0 publishes it after every step), not a listing
        if killed_at is None and (fs.get_file_info(f"{path}/grpo/e2e/steps.jsonl").size or 0) > 0:
            stop_node(str(cluster["temp_dirs"]["b"]))
            killed_at = time.time() - t0
        time.sleep(0.5)
    if job.poll() is None:
        job.kill()
    job.wait(timeout=60)
    time.sleep(0.5)  # the pump thread reads the last lines
    out = "\n".join(lines)
    print(out)
    print(f"first submission: {time.time() - t0:.0f} s, node b killed at {killed_at} s")
    assert job.returncode == 0 and "OK —" in out, out[-6000:]
    assert killed_at is not None, "GRPO finished before the node could be killed"

    # every stage's outputs and checkpoints are in the bucket
    files = _files(root)
    for want in ("synthesize/", "trajectories/", "sft/", "grpo/e2e/"):
        assert any(f.startswith(want) and f.endswith("config.yaml") for f in files), want
    assert any(f.startswith("synthesize/") and f.endswith("/rl.parquet") for f in files)
    assert any(f.startswith("synthesize/") and "/images/" in f for f in files)
    assert any(f.startswith("trajectories/") and "/trajectories.parquet/part-" in f for f in files)
    assert any(f.startswith("sft/") and "/model/model.safetensors" in f for f in files)
    assert any(f.startswith("sft/") and "/train/checkpoint_" in f for f in files)  # Ray Train's, from its worker
    assert f"{CKPT}/step_{STEPS:06d}/hf/model.safetensors" in files
    assert "grpo/e2e/report.json" in files
    # the last checkpoint: both learner ranks' ZeRO-3 shards (written on two nodes), then the marker listing them
    marker = json.loads(_read(root, f"{CKPT}/step_{STEPS:06d}/COMPLETE"))
    assert marker["step"] == STEPS and marker["world"] == 2
    assert {f"{CKPT}/step_{STEPS:06d}/{rel}" for rel in marker["files"]} <= set(files)
    for rank in (0, 1):
        shards = _rank_shards(files, STEPS, rank)
        assert len(shards) == 2, (rank, shards)  # model states and optimizer states (Adam moments)
        assert {s.removeprefix(f"{CKPT}/step_{STEPS:06d}/") for s in shards} <= set(marker["files"])
    kept = sorted({f.split("/")[3] for f in files if f.startswith(f"{CKPT}/step_")})
    assert kept == [f"step_{s:06d}" for s in (STEPS - 1, STEPS)], kept  # train.keep=2: step 1 pruned
    assert all(f"{CKPT}/{k}/COMPLETE" in files for k in kept)
    # the learner nodes keep no copy of a checkpoint: the bucket holds them
    copies = {n: _checkpoint_copies(c) for n, c in (("a", cluster["caches"]["a"]), ("c", cache_c))}
    assert not any(copies.values()), copies
    # ... and no run folder anywhere else: the checkout, the nodes' temp dirs (Ray's working-dir cache), /tmp
    stray = [p for p in _local_run_folders(cluster) + _run_folders(node_c) if p not in before]
    assert not stray, stray

    # the job went on without node b: every step trained, every issued group trained once or dropped with a reason
    summary = json.loads(_read(root, "grpo/e2e/summary.json"))
    rows = [json.loads(x) for x in _read(root, "grpo/e2e/steps.jsonl").splitlines() if x.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    trained = [g for r in rows for g in r["group_ids"]]
    assert len(trained) == len(set(trained))
    ledger = summary["ledger"]
    assert set(trained) == {g for g, v in ledger.items() if v["state"] == "consumed"}
    assert all(v["state"] == "consumed" or (v["state"] == "dropped" and v["reason"]) for v in ledger.values())
    assert summary["restarts"], "the rollout actor on the killed node was not replaced"
    # versions crossed nodes over the weight group (learner rank 0 on one node, the engines on others), collected
    # from both learner ranks' ZeRO-3 partitions; every live engine holds the last one bit for bit (a replacement
    # that joined after it, from the object store, where the learner leaves the run's last version)
    sent = rows[-1]["weights"]
    live = [a for a in summary["actors"] if a["alive"]]
    assert live and sent["sha256"] and sent["rebuilds"] >= 2, (sent, summary["actors"])
    assert any(a["weights"]["versions_group"] >= 1 for a in live), summary["actors"]
    for a in live:
        assert a["weights_sha256"] == sent["sha256"], (a, sent)
    # the driver's live step table shows every step, although learner rank 0 wrote the rows on another node
    from osvl.rl.report import format_row

    assert all(format_row(r) in out for r in rows), "the live step table misses steps"

    # where each role ran, from Ray's state API
    nodes = {n.node_id: n for n in cluster["state"]("nodes", detail=True)}
    head = {i for i, n in nodes.items() if n.is_head_node}
    gpu = {i for i, n in nodes.items() if n.resources_total.get("GPU", 0) > 0}
    learner = {i for i, n in nodes.items() if n.resources_total.get("learner", 0) > 0}
    actors = cluster["state"]("actors", detail=True)
    tasks = cluster["state"]("tasks", detail=True)
    rollout = {a.node_id for a in actors if a.class_name == "RolloutWorker"}
    workers = {a.node_id for a in actors if a.class_name == "RayTrainWorker"}
    evals = {t.node_id for t in tasks if t.name == "heldout_eval" and t.node_id}
    data = {a.node_id for a in actors if "Map" in (a.class_name or "")}  # Ray Data's map actors and tasks
    data |= {t.node_id for t in tasks if t.node_id and any(k in t.name for k in ("Map", "Read", "Filter"))}
    assert len(rollout) == 2 and rollout <= gpu, "rollout actors spread over the GPU nodes"
    assert evals and evals <= gpu
    assert workers and workers <= learner
    assert len(workers) == 2, "the two learner ranks share a node"  # a and c: one unit of `learner` each
    assert data and not data & head
    assert not (rollout | workers | evals) & head

    # lose every node-local cache, submit the same command again with one more step: nothing recomputed,
    # GRPO resumes from the last checkpoint (every rank pulls both ranks' shards from the bucket)
    saved_probe = json.loads(_read(root, f"{CKPT}/step_{STEPS:06d}/probe.json"))
    for cache in [*cluster["caches"].values(), cache_c]:
        shutil.rmtree(cache, ignore_errors=True)
    t1 = time.time()
    again, lines2 = _submit(cluster, root, steps=STEPS + 1)
    again.wait(timeout=900)
    time.sleep(0.5)
    out2 = "\n".join(lines2)
    print(out2)
    print(f"resubmission: {time.time() - t1:.0f} s")
    assert again.returncode == 0 and "OK —" in out2, out2[-6000:]
    assert "0 to run" in out2.split("synthesize:")[1]  # every shard reused
    assert "sft: reusing" in out2
    assert f"resuming from step_{STEPS:06d}" in out2
    rows2 = [json.loads(x) for x in _read(root, "grpo/e2e/steps.jsonl").splitlines() if x.strip()]
    assert [r["step"] for r in rows2] == list(range(1, STEPS + 2))  # no step trained twice, the new one once
    # the learner loaded what was saved: rank 0's weights and Adam moments right after loading
    resumed_probe = json.loads(_read(root, f"{CKPT}/resume_probe.json"))
    print(f"saved probe {saved_probe}\nresumed probe {resumed_probe}")
    assert resumed_probe["step"] == saved_probe["step"] == STEPS
    assert abs(resumed_probe["exp_avg_abs_sum"] - saved_probe["exp_avg_abs_sum"]) <= 1e-6
    # bit for bit: rank 0's weight partition and its Adam moments (at these sizes every reward is 0, so the
    # moments are zeros; tests/test_checkpoint_marker.py resumes non-zero ones across two nodes' shards)
    assert all(resumed_probe[k] == saved_probe[k] for k in ("weights", "exp_avg", "exp_avg_sq"))
    files2 = _files(root)
    kept2 = sorted({f.split("/")[3] for f in files2 if f.startswith(f"{CKPT}/step_")})
    assert kept2 == [f"step_{s:06d}" for s in (STEPS, STEPS + 1)], kept2  # the new one, marked; step 2 pruned
    assert json.loads(_read(root, f"{CKPT}/step_{STEPS + 1:06d}/COMPLETE"))["world"] == 2
    assert all(len(_rank_shards(files2, STEPS + 1, rank)) == 2 for rank in (0, 1))
    copies = {n: _checkpoint_copies(c) for n, c in (("a", cluster["caches"]["a"]), ("c", cache_c))}
    assert not any(copies.values()), copies  # the pulled checkpoint and the new one: gone from the nodes
    assert os.environ.get("AWS_EC2_METADATA_DISABLED") == "true"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tool_replicas_run_where_the_tools_resource_is(multinode_cluster):
    """The tool API submitted as a job with ``--role_units``: its replicas (Ray state API) sit on the node that
    declares ``tools``, none on the head, and a call through the HTTP proxy is answered."""
    import base64
    import io
    import re
    import urllib.request

    import numpy as np
    from PIL import Image

    from osvl.cluster import ROLE_RESOURCES, free_port

    cluster = multinode_cluster
    port = free_port()
    ray_bin = str(Path(sys.executable).parent)
    cmd = [f"{ray_bin}/ray", "job", "submit", "--address", cluster["address"], "--no-wait", "--working-dir", ".",
           "--", "python", "-m", "serve.app", "--tools=crop", "--role_units=0.1", f"--port={port}"]
    submitted = subprocess.run(cmd, cwd=REPO, env=cluster["env"], capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)
    png = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(png, format="PNG")
    body = json.dumps({"arguments": {"image": "img_1", "x": 2, "y": 3, "width": 5, "height": 4},
                       "images": {"img_1": base64.b64encode(png.getvalue()).decode()}}).encode()
    try:
        deadline, answer = time.time() + 180, None
        while answer is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/tools/crop", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    answer = json.loads(resp.read())
            except OSError:
                assert time.time() < deadline, "the tool API did not come up"
                time.sleep(2)
        assert answer["status"] == "ok", answer
        nodes = {n.node_id: n for n in cluster["state"]("nodes", detail=True)}
        tools_nodes = {i for i, n in nodes.items() if n.resources_total.get(ROLE_RESOURCES["tools"], 0) > 0}
        head = {i for i, n in nodes.items() if n.is_head_node}
        # crop runs inline in the ingress for HTTP calls, so the answer can come before the tool_crop replica
        # (there for handle callers) is up: on a loaded machine it was still starting when first listed
        wanted, deadline = {"ServeReplica:osvl_tools:tool_crop", "ServeReplica:osvl_tools:api"}, time.time() + 120
        while True:
            replicas = {a.class_name: a.node_id for a in cluster["state"]("actors", detail=True)
                        if (a.class_name or "").startswith("ServeReplica:osvl_tools:") and a.state == "ALIVE"}
            if set(replicas) >= wanted or time.time() > deadline:
                break
            time.sleep(2)
        assert set(replicas) == wanted, replicas
        assert set(replicas.values()) <= tools_nodes and not set(replicas.values()) & head
    finally:
        env = cluster["env"]
        subprocess.run([f"{ray_bin}/ray", "job", "stop", "--address", cluster["address"], job_id], env=env,
                       capture_output=True, timeout=120)
        subprocess.run([f"{ray_bin}/serve", "shutdown", "-y", "--address", cluster["address"]], env=env,
                       capture_output=True, timeout=120)


@pytest.mark.slow
def test_every_socket_of_the_multinode_cluster_is_reachable_from_loopback_only(multinode_cluster):
    """Ray 2.60 binds its GCS and raylets to '::' once RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (which joining
    nodes needs), so the fixture runs only in a namespace whose one interface is ``lo`` (tests/netns.sh):
    a socket is either on a loopback address or on a wildcard address of that namespace. psutil lists the
    sockets of this process's namespace only, so the cluster's sockets being found at all places its
    processes in it."""
    listening = _listening_ips(list(multinode_cluster["temp_dirs"].values()))
    assert listening, "no listening socket found for the cluster's processes"
    off_loopback = {ip for ip in listening if not (ip.startswith("127.") or ip == "::1")}
    assert off_loopback <= {"0.0.0.0", "::"}, off_loopback  # never a concrete non-loopback address
