"""Observability end to end: the committed Prometheus files pass promtool, and a real Prometheus scrapes a
real GRPO job through Ray's service discovery, reads osvl's series by their own labels, parses every panel
query, and fires the fatal-rate alert from the committed rules.

Debian's ``prometheus`` package gives ``prometheus`` and ``promtool``; without them these tests skip, unless
``OSVL_REQUIRE_PROMETHEUS=1`` (CI sets it) makes that a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DASH = REPO / "dashboards"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not installed (apt-get install prometheus)"
        if os.environ.get("OSVL_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(msg + "; OSVL_REQUIRE_PROMETHEUS=1 requires it")
        pytest.skip(msg)
    return path


def _promtool(*args: str) -> str:
    out = subprocess.run([_tool("promtool"), *args], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_promtool_accepts_the_config_and_the_rules_and_every_alert_has_a_unit_test():
    assert "SUCCESS" in _promtool("check", "config", "dashboards/prometheus.yml")
    assert "SUCCESS: 7 rules found" in _promtool("check", "rules", "dashboards/alerts.yml")
    assert "SUCCESS" in _promtool("test", "rules", "dashboards/alerts_test.yml")
    alerts = {r["alert"] for g in yaml.safe_load((DASH / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    tests = yaml.safe_load((DASH / "alerts_test.yml").read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert firing == alerts  # every alert is shown firing at least once


def test_recorder_checks_tags_and_eval_pass_at_1_so_far():
    from osvl import metrics as M

    rec = M.Recorder("eval", "unit-run")
    with pytest.raises(ValueError, match="takes tags"):
        rec.set(M.EVAL_PASS1, 0.5, benchmark="b")  # mode missing
    with pytest.raises(ValueError, match="never be 'job'"):
        M.MetricSpec("osvl_x", "gauge", "x", M.LABELS + ("job",))
    assert all(s.tag_keys[:2] == ("osvl_job", "run") for s in M.SPECS.values())
    got = [M.record_eval_item(rec, "bench-a", "agent", c) for c in (True, False, False, True)]
    assert got == [1.0, 0.5, 1 / 3, 0.5]
    assert M.record_eval_item(rec, "bench-a", "direct", False) == 0.0  # each mode its own tally
    assert M.record_eval_item(M.Recorder("eval", "other-run"), "bench-a", "agent", True) == 1.0


# ---------------------------------------------------------------------------
# a real Prometheus on loopback, a real GRPO job on its own local cluster


def _free_port() -> int:
    from osvl.cluster import free_port

    return free_port()


def _get(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # a bad query answers 400 with a JSON error body
        return json.loads(e.read())


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/-/ready", timeout=5) as resp:
            return resp.status == 200
    except OSError:  # not listening yet, or still loading its storage (503)
        return False


def _stop_group(proc: subprocess.Popen, tmp: Path) -> None:
    """Stop the job's process group, then whatever of its cluster still runs (found by its own Ray temp dir)."""
    import psutil

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    leftovers = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(tmp) in " ".join(p.info["cmdline"] or []):
                leftovers.append(p)
        except psutil.Error:
            continue
    for p in leftovers:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.slow
def test_prometheus_scrapes_a_grpo_job_by_osvl_labels_and_fires_the_fatal_rate_alert(tmp_path):
    """The random tiny model writes only unparsable turns, so every episode is fatal (fatal rate 1.0): one job
    run shows the learner, rollout and engine series arrive and makes OsvlFatalRateSpike pending."""
    prometheus = _tool("prometheus")
    from osvl.models.tiny import tiny_checkpoint

    # Ray's temp dir must be short (unix socket paths) and this test's own: /tmp/ray's discovery file is
    # shared by every cluster on the machine that uses the default
    tmp = Path(tempfile.mkdtemp(prefix="osvl-obs-", dir="/tmp"))
    cfg = yaml.safe_load((DASH / "prometheus.yml").read_text())
    # the committed config, with only the discovery file list pointed at this job's temp dir and the rule
    # file made absolute (the config is written elsewhere)
    cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(tmp / "ray" / "prom_metrics_service_discovery.json")]
    cfg["rule_files"] = [str(DASH / name) for name in cfg["rule_files"]]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp / 'tsdb'}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    from osvl.agent.scripted import question_folder

    questions = question_folder(tmp_path / "questions")
    ready = time.time() + 120
    while not _ready(base) and time.time() < ready and prom.poll() is None:
        time.sleep(1)
    if not _ready(base):
        prom.kill()
        pytest.fail("Prometheus did not become ready: " + (tmp / "prometheus.log").read_text()[-2000:])
    run = f"obs-{os.getpid()}"
    cmd = [sys.executable, str(REPO / "jobs" / "grpo.py"), f"--run.root={tmp_path / 'runs'}", f"--run.name={run}",
           f"--questions={questions}", f"--model={tiny_checkpoint('qwen3_vl')}", "--eval.n_heldout=0",
           "--rl.group_size=2", "--rl.beta=0", "--train.steps=200", "--train.groups_per_step=1",
           "--train.ckpt_every=1000", "--rollout.groups_in_flight=2", "--rollout.agent.max_turns=3",
           "--rollout.agent.max_new_tokens=24", "--rollout.agent.max_episode_tokens=2048",
           "--rollout.offer=crop,text_search",
           f"--rollout.schemas={questions / 'schemas.json'}"]
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": str(tmp)}

    def start_job() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=(tmp / "job.log").open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    job, restarts = start_job(), 0
    sel = f'osvl_job="grpo", run="{run}"'
    wanted = {  # learner, rollout and engine series, selected by osvl's labels only
        "learner": f"ray_osvl_rl_fatal_ratio{{{sel}}}",
        "learner_loss": f"ray_osvl_train_loss{{{sel}}}",
        "rollout": f"ray_osvl_rollout_episodes_total{{{sel}}}",
        "engine": f'ray_osvl_engine_tokens_total{{{sel}, phase="decode"}}',
        "alert": f'ALERTS{{alertname="OsvlFatalRateSpike", {sel}}}',
    }
    found: dict[str, list] = {}
    try:
        t0 = time.time()
        deadline = t0 + 600  # left as soon as all arrive; a loaded machine starts Ray and Ray Train slowly
        while time.time() < deadline and set(found) != set(wanted):
            if job.poll() is not None:
                # Ray gives a new node 30 s (hard-coded) to register; a machine at load 100 can miss that
                if restarts < 2 and "timed out during startup" in (tmp / "job.log").read_text():
                    _stop_group(job, tmp)
                    job, restarts = start_job(), restarts + 1
                    continue
                break
            for key, query in wanted.items():
                if key not in found:
                    res = _get(base, "/api/v1/query", query=query)
                    if res.get("status") == "success" and res["data"]["result"]:
                        found[key] = res["data"]["result"]
                        print(f"{key}: after {time.time() - t0:.0f} s")
            time.sleep(2)
        log = (tmp / "job.log").read_text()[-3000:]
        assert set(found) == set(wanted), f"missing {set(wanted) - set(found)}; job log tail:\n{log}"

        # osvl's values under osvl's labels; Prometheus's own job label is the scrape job, not renamed over ours
        for series in found["learner"]:
            assert series["metric"]["job"] == "ray" and "exported_job" not in series["metric"]
            assert float(series["value"][1]) == 1.0  # every episode fatal
        rows = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / run / "steps.jsonl").read_text().splitlines()]
        trained = [r for r in rows if r["trajectories"]]  # a step whose groups were all dropped (stale) has none
        assert trained and all(r["fatal_rate"] == 1.0 for r in trained)
        losses = [r["loss"] for r in rows if "loss" in r]
        assert any(abs(float(s["value"][1]) - x) < 1e-6 for s in found["learner_loss"] for x in losses)
        assert {s["metric"]["stop_reason"] for s in found["rollout"]} == {"fatal"}
        assert sum(float(s["value"][1]) for s in found["engine"]) > 0
        assert found["alert"][0]["metric"]["alertstate"] in ("pending", "firing")
        by_job = _get(base, "/api/v1/query", query='sum by (osvl_job, run) (ray_osvl_rl_fatal_ratio)')
        assert {"osvl_job": "grpo", "run": run} in [s["metric"] for s in by_job["data"]["result"]]

        # every panel query of the committed dashboards parses on this server (variables: "All")
        bad = []
        for board in sorted(DASH.glob("osvl-*.json")):
            for panel in json.loads(board.read_text())["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$osvl_job", ".*").replace("$run", ".*")
                    res = _get(base, "/api/v1/query", query=expr)
                    if res.get("status") != "success":
                        bad.append((board.name, panel["title"], res.get("error")))
        assert not bad, bad

        # the committed render script draws the run's panels from this server
        png = tmp_path / "dashboards.png"
        out = subprocess.run([sys.executable, str(DASH / "render.py"), f"--prometheus={base}", "--boards=rl,rollout",
                              f"--run={run}", "--minutes=15", "--skip-empty", f"--out={png}"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert png.stat().st_size > 10_000 and " with data" in out.stdout, out.stdout
    finally:
        _stop_group(job, tmp)
        prom.terminate()
        prom.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
