"""`ray up` on deploy/cluster-local.yaml, for real: over SSH to an OpenSSH server on loopback.

The "node" is this machine reached as a user of its own (``osvl-node``), as the config asks for a
real site: every Ray process of the cluster runs as that user, so the ``ray stop`` that ``ray up``
and ``ray down`` run on the node can signal nothing else (other Ray clusters on this machine run as
other users; a sentinel process that ``ray stop`` would match proves it). sshd listens on
127.0.0.1 on a free port with a throwaway host key and user key in a temp dir; Ray has no SSH port
setting, so the config's ``auth.ssh_proxy_command`` connects to it. The site settings of the config
are replaced as a user would edit them: the head address becomes 127.0.0.1, every port a free one,
``node_setup.sh`` reuses the venv running this test (seconds instead of a full install), the token
file a fresh one.

Every server binds 127.0.0.1: sshd's ``SetEnv`` gives the node's Ray
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, as ``osvl.cluster`` does locally.
Needs root (sshd switching to the node user), Debian's openssh-server and rsync; skipped without
them unless ``OSVL_REQUIRE_SSHD=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from osvl.cluster import ROLE_RESOURCES, free_port

REPO = Path(__file__).resolve().parents[1]
NODE_USER = "osvl-node"
SSHD = "/usr/sbin/sshd"
PROXY = """import os, socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while data := os.read(0, 65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    while data:
        data = data[os.write(1, data):]
"""
JOB = """import json, sys
import ray
from osvl.cluster import init_ray

init_ray()

@ray.remote(resources={"tools": 1})
def where():
    import osvl
    return {"python": sys.executable, "osvl": osvl.__file__}

print("OSVL-JOB", json.dumps({**ray.get(where.remote()), "resources": sorted(ray.cluster_resources())}))
"""


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root (sshd switches to the node user)"
    for tool in (SSHD, shutil.which("ssh"), shutil.which("rsync"), shutil.which("ssh-keygen")):
        if not tool or not Path(tool).exists():
            return "needs openssh-server, openssh-client and rsync (apt-get install -y openssh-server rsync)"
    return ""


@pytest.fixture
def sshd():
    why = _missing()
    if why:
        if os.environ.get("OSVL_REQUIRE_SSHD") == "1":
            pytest.fail(f"OSVL_REQUIRE_SSHD=1 but {why}")
        pytest.skip(why)
    try:
        pwd.getpwnam(NODE_USER)
    except KeyError:  # '*': no password, but not locked (sshd refuses locked accounts without PAM)
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", "--password", "*", NODE_USER],
                       check=True)
    home = Path(pwd.getpwnam(NODE_USER).pw_dir)
    # short (ssh's control path has a length limit) and traversable: sshd reads the keys as the node user
    tmp = Path(tempfile.mkdtemp(prefix="osvl-sshd-"))
    tmp.chmod(0o755)
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / key)], check=True)
    (tmp / "authorized_keys").write_text((tmp / "user_key.pub").read_text())
    (tmp / "authorized_keys").chmod(0o644)
    port = free_port()
    (tmp / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {tmp}/host_key
PidFile {tmp}/sshd.pid
AuthorizedKeysFile {tmp}/authorized_keys
AllowUsers {NODE_USER}
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")], stderr=open(tmp / "sshd.log", "w"))
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"sshd did not start: {(tmp / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)
    (tmp / "proxy.py").write_text(PROXY)
    yield {"port": port, "tmp": tmp, "home": home, "proc": proc}
    proc.terminate()
    proc.wait(10)
    _kill_node_user()
    shutil.rmtree(tmp, ignore_errors=True)


def _node_pids() -> list[int]:
    import psutil

    uid = pwd.getpwnam(NODE_USER).pw_uid
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]


def _kill_node_user() -> None:
    """Cleanup after a failure: the node user's processes are all this test's."""
    import psutil

    for pid in _node_pids():
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def site_config(sshd: dict, token_file: Path, name: str) -> tuple[dict, dict[str, int]]:
    """deploy/cluster-local.yaml with this machine's site settings; returns it and the port map."""
    text = (REPO / "deploy" / "cluster-local.yaml").read_text()
    head_ip = yaml.safe_load(text)["provider"]["head_ip"]
    text = text.replace(head_ip, "127.0.0.1")
    ports = {int(p) for p in re.findall(r"--[a-z-]*port=(\d+)", text)}
    mapping = {p: free_port() for p in ports}
    for old, new in mapping.items():
        text = re.sub(rf"(?<=[=:]){old}\b", str(new), text)
    venv = Path(sys.executable).parent.parent
    text = text.replace('node_setup.sh ""', f'node_setup.sh "{venv}"')
    cfg = yaml.safe_load(text)
    cfg["cluster_name"] = name
    cfg["auth"] = {"ssh_user": NODE_USER, "ssh_private_key": str(sshd["tmp"] / "user_key"),
                   "ssh_proxy_command": f"{sys.executable} -S {sshd['tmp'] / 'proxy.py'} 127.0.0.1 {sshd['port']}"}
    cfg["file_mounts"]["~/.ray/auth_token"] = str(token_file)
    return cfg, mapping


def _sentinel() -> subprocess.Popen:
    """A process `ray stop` would kill if it could signal it: its command line names Ray's dashboard."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "ray/dashboard/dashboard.py"])


@pytest.mark.slow  # ray up, a job and ray down over SSH (~1-2 min)
def test_ray_up_submit_and_down_over_ssh(sshd, tmp_path):
    token_file = sshd["tmp"] / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o644)
    name = f"osvl-up-{uuid.uuid4().hex[:8]}"
    cfg, ports = site_config(sshd, token_file, name)
    config_path = sshd["tmp"] / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    sentinel = _sentinel()
    up_done = False
    try:
        for _ in range(2):
            up = subprocess.run([str(bin_dir / "ray"), "up", "-y", "--no-config-cache", "--log-style=record",
                                 str(config_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
            up_done = True
            # `ray start` gives the raylet a fixed 30 s to register with the GCS; on a machine loaded far
            # past its cores (parallel test sessions) that can pass, and `ray up` is safe to rerun
            if up.returncode == 0 or "timed out during startup" not in up.stdout + up.stderr:
                break
        assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]
        head_procs = _node_pids()
        assert head_procs, "ray up returned but no process runs as the node user"

        jobdir = tmp_path / "job"
        jobdir.mkdir()
        (jobdir / "job.py").write_text(JOB)
        dashboard = f"http://127.0.0.1:{ports[8265]}"
        job_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token_file.read_text()}
        sub_id = f"osvl-up-{uuid.uuid4().hex[:6]}"
        submit = subprocess.run([str(bin_dir / "ray"), "job", "submit", "--address", dashboard, "--submission-id",
                                 sub_id, "--working-dir", str(jobdir), "--", "python", "job.py"],
                                env=job_env, capture_output=True, text=True, timeout=300)
        assert submit.returncode == 0 and "succeeded" in submit.stdout, (submit.stdout + submit.stderr)[-4000:]
        logs = subprocess.run([str(bin_dir / "ray"), "job", "logs", "--address", dashboard, sub_id],
                              env=job_env, capture_output=True, text=True, timeout=60)
        line = next(x for x in logs.stdout.splitlines() if x.startswith("OSVL-JOB "))
        import json

        job = json.loads(line.removeprefix("OSVL-JOB "))
        home = str(sshd["home"])
        assert job["python"].startswith(f"{home}/osvl/.venv/bin/python")   # the venv was on PATH
        assert job["osvl"] == f"{home}/osvl/osvl/__init__.py"               # the rsynced checkout
        assert {ROLE_RESOURCES["tools"], ROLE_RESOURCES["data"]} <= set(job["resources"])  # the head's roles
        assert not (sshd["home"] / "osvl" / "runs").exists()  # the rsync filter left runs behind

        # without the token the job server refuses: token auth is on
        anon = subprocess.run([str(bin_dir / "ray"), "job", "list", "--address", dashboard],
                              env={k: v for k, v in env.items() if not k.startswith("RAY_AUTH")} | {
                                  "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
        assert anon.returncode != 0 and re.search(r"401|nauthori[sz]ed|uthenticat", anon.stdout + anon.stderr), (
            anon.stdout + anon.stderr)[-2000:]
    finally:
        if up_done:
            down = subprocess.run([str(bin_dir / "ray"), "down", "-y", "--log-style=record", str(config_path)],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        for f in Path("/tmp/ray").glob(f"cluster-{name}.*"):
            f.unlink()
    assert down.returncode == 0, (down.stdout + down.stderr)[-4000:]
    deadline = time.time() + 30
    while _node_pids() and time.time() < deadline:
        time.sleep(1)
    assert _node_pids() == [], "ray down left processes of the cluster running"
    assert sentinel.poll() is None, "ray stop touched a process it did not start"
    sentinel.kill()
    sentinel.wait()
    sshd["proc"].terminate()
    assert sshd["proc"].wait(10) is not None
