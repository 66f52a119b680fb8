"""The one storage layer: a run root is a local folder or a URI (``s3://``, ``gs://``, ``file://``).

Why: once a job runs on more than one node (``ray job submit --working-dir .``), a local
path names a different disk on every node, and Ray's working-dir cache on whichever node
ran the driver. What a later stage, a resumed run or another node reads must live in
storage every node reaches; node-local folders can only be caches.

How, with the least machinery: every job keeps writing into an ordinary local folder
(``config.run_dir``). When the run root is a URI, that folder is a node-local *mirror*
of ``<root>/<job>/<config hash>/`` under ``$OSVL_CACHE/storage/``: ``run_dir`` pulls the
remote folder into it first (so a resumed run finds its finished shards, checkpoints and
reports), and the job ``publish``-es the folder back after each finished piece of work.
Deleting the mirror loses nothing that was published. Ray Train's checkpoints go straight
to the remote folder through ``train_storage`` (``RunConfig(storage_path=...,
storage_filesystem=...)``), since Ray Train refuses a local ``storage_path`` once its
workers span nodes.

Everything goes through ``pyarrow.fs``, the filesystem layer Ray Train and Ray Data use:
credentials and endpoints come from each filesystem's standard environment and config
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``
for S3-compatible stores; ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS). A root is checked
once, at start (``open_root``): an unknown scheme, an unreachable endpoint, missing
credentials or a missing bucket fail with one line naming the setting, before anything
is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from osvl.errors import DataError, StorageError

SCHEMES = ("file", "s3", "gs")
MARKER = ".osvl-remote"  # in a mirror folder: the URI it mirrors
SYNCED = ".osvl-synced.jsonl"  # in a mirror folder: the sync ledger (``_synced``)
PULL_LOCK = ".osvl-pull.lock"  # in a mirror folder: held by the node's one pull in progress


def is_uri(root: str) -> bool:
    """True for ``scheme://...``; a plain path (relative or absolute) is not a URI."""
    return "://" in str(root)


def is_remote(root: str) -> bool:
    """True when ``root`` names storage other than this node's disk."""
    return is_uri(root) and urlparse(str(root)).scheme != "file"


def join(root: str, *parts: str) -> str:
    """``root/part/...`` for a path or a URI."""
    return "/".join([str(root).rstrip("/"), *(p.strip("/") for p in parts)])


def _credentials_missing_s3() -> bool:
    """No AWS credentials anywhere the SDK looks, with the metadata service switched off."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return False
    if any(os.environ.get(k) for k in ("AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                                       "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                                       "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")):
        return False
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
             os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")]
    if any(Path(f).expanduser().is_file() for f in files):
        return False
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"


def _s3(setting: str, uri: str) -> Any:
    if _credentials_missing_s3():
        raise StorageError(f"{setting}={uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                           "or AWS_PROFILE)")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    kwargs: dict[str, Any] = {"connect_timeout": 5.0, "request_timeout": 30.0,
                              "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                              or "us-east-1",
                              "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
    if endpoint:
        ep = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs.update(endpoint_override=ep.netloc, scheme=ep.scheme)
    return pafs.S3FileSystem(**kwargs)


@functools.cache
def _open(uri: str, setting: str) -> tuple[Any, str]:
    if not is_uri(uri):
        return pafs.LocalFileSystem(), str(Path(uri).resolve())
    parsed = urlparse(uri)
    if parsed.scheme not in SCHEMES:
        raise StorageError(f"{setting}={uri}: unknown scheme {parsed.scheme!r}; use a local path or one of "
                           + ", ".join(f"{s}://" for s in SCHEMES))
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), parsed.path
    if not parsed.netloc:
        raise StorageError(f"{setting}={uri}: no bucket in the URI ({parsed.scheme}://BUCKET/PATH)")
    fs = _s3(setting, uri) if parsed.scheme == "s3" else pafs.GcsFileSystem()
    path = f"{parsed.netloc}{parsed.path}".rstrip("/")
    try:
        info = fs.get_file_info(parsed.netloc)  # the bucket: reachable, credentials accepted, it exists
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"{setting}={uri}: storage not reachable or credentials refused ({first})") from None
    if info.type.name == "NotFound":
        raise StorageError(f"{setting}={uri}: bucket {parsed.netloc!r} does not exist")
    return fs, path


def open_root(root: str, setting: str = "run.root") -> tuple[Any, str]:
    """``(pyarrow filesystem, path inside it)`` for a local path or URI, checked once per process.

    Raises ``StorageError`` (one line naming ``setting``) for an unknown scheme, an
    unreachable endpoint, missing or refused credentials, or a missing bucket.
    """
    return _open(str(root).rstrip("/") if is_uri(root) else str(root), setting)


def cache_root() -> Path:
    """``$OSVL_CACHE`` or ``~/.cache/osvl``: where built artifacts live between runs."""
    return Path(os.environ.get("OSVL_CACHE") or Path.home() / ".cache" / "osvl")


def mirror_dir(uri: str) -> Path:
    """The node-local cache folder that mirrors the remote folder ``uri`` (a cache: deleting it loses
    nothing published), under ``$OSVL_STORAGE_CACHE`` (default ``$OSVL_CACHE/storage``)."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    # keyed by the parent's URI, named like the remote folder (code may read a run folder's name)
    base = Path(os.environ.get("OSVL_STORAGE_CACHE") or cache_root() / "storage")
    return base / hashlib.sha256(parent.encode()).hexdigest()[:16] / name


@contextlib.contextmanager
def atomic(path: str | Path) -> Iterator[Path]:
    """``with atomic(path) as tmp: write tmp``: renamed onto ``path`` when the block ends, removed if it fails.

    Every file a reader, a resumed run or another node may find half-written goes through here: the
    rename is atomic on POSIX, so ``path`` holds the old content or the new, never part of it. The
    temporary name is unique per writer (writers on one node race for content-addressed files) and
    ends in ``.tmp``, which ``publish`` never uploads.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (``atomic``)."""
    with atomic(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_once(path: str | Path, data: bytes) -> bool:
    """A content-addressed store's put: ``path`` is named by a hash of ``data``, so an existing file already
    holds it; otherwise written atomically. Returns whether it wrote."""
    if Path(path).exists():
        return False
    atomic_write(path, data)
    return True


_LEDGERS: dict[str, tuple[int, int, dict[str, list[int]]]] = {}  # ledger path -> (inode, bytes read, entries)
_LEDGER_LOCK = threading.RLock()  # threads of one process publish concurrently (rollout actors' image uploads)


def _synced(local: Path) -> dict[str, list[int]]:
    """The mirror's sync ledger: each file as it was at its last pull or publish, ``rel -> [size, mtime_ns]`` (and
    ``@rel`` -> the stored object's ``[size, mtime_ns]``).

    An append-only JSON-lines file, the last line of a key winning: publishing one image appends its two lines
    instead of rewriting every entry (a run's rollouts publish tens of thousands of images, and a rewrite per
    image made the run quadratic). This process keeps what it has read and reads only what was appended since,
    by any process sharing the mirror; a ledger replaced by a compaction (another inode) is read afresh. A torn
    last line (a writer killed mid-append) is skipped: a lost entry only costs a re-upload or a re-pull.
    Returns this process's cached view: read it, never change it (``_save_synced`` adds entries).
    """
    f = local / SYNCED
    with _LEDGER_LOCK:
        try:
            st = f.stat()
        except FileNotFoundError:
            _LEDGERS.pop(str(f), None)
            return {}
        inode, done, entries = _LEDGERS.get(str(f), (-1, 0, {}))
        if inode != st.st_ino or st.st_size < done:
            done, entries = 0, {}
        if st.st_size > done:
            with open(f, "rb") as fh:
                fh.seek(done)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a line still being appended waits for the next read
            for line in data[:end].splitlines():
                try:
                    key, value = json.loads(line)
                    entries[key] = value
                except (ValueError, TypeError):
                    continue
            done += end
        _LEDGERS[str(f)] = (st.st_ino, done, entries)
        return entries


def _save_synced(local: Path, changed: dict[str, list[int]]) -> None:
    """Append ``changed`` entries to the ledger; compact it (an atomic rewrite) once superseded lines outnumber
    live ones."""
    if not changed:
        return
    f = local / SYNCED
    lines = "".join(json.dumps([k, v]) + "\n" for k, v in changed.items()).encode()
    with _LEDGER_LOCK:
        fd = os.open(f, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines)  # one write: appends of processes sharing the mirror do not interleave
        finally:
            os.close(fd)
        entries = _synced(local)  # now with the lines just appended
        if f.stat().st_size > 2 * len(entries) * 64 + (1 << 20):  # about twice the live lines, and over 1 MiB
            atomic_write(f, "".join(json.dumps([k, v]) + "\n" for k, v in entries.items()))


def _stat(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns]


PULL_CHUNK = 8 << 20  # bytes read and written at a time: a pull's memory does not grow with the file


@contextlib.contextmanager
def _pull_lock(local: Path) -> Iterator[None]:
    """One pull of a mirror at a time on this node: ranks, actors and tasks of one node share a mirror, and the
    second caller then finds the files pulled (an advisory ``flock``, released if the holder dies)."""
    local.mkdir(parents=True, exist_ok=True)
    with open(local / PULL_LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull(uri: str, local: Path) -> bool:
    """Copy the remote folder ``uri`` into ``local``, skipping files already pulled unchanged; False
    when nothing is stored at ``uri`` yet.

    Each file streams into a temporary file in ``PULL_CHUNK`` pieces and is renamed into place (``atomic``):
    a reader sees the old file or the whole new one, never part of it, and a pull holds one chunk in memory
    whatever the file's size. Concurrent pulls of one mirror on a node take turns (``_pull_lock``)."""
    fs, path = open_root(uri)
    if fs.get_file_info(path).type.name == "NotFound":
        return False
    with _pull_lock(local):
        synced, changed = _synced(local), {}
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type.name != "File":
                continue
            rel = info.path[len(path):].lstrip("/")
            dst = local / rel
            remote_ns = int(info.mtime_ns or 0)
            if dst.is_file() and synced.get(rel) == _stat(dst) and synced.get("@" + rel) == [info.size, remote_ns]:
                continue
            _download(fs, info.path, dst)
            changed[rel], changed["@" + rel] = _stat(dst), [info.size, remote_ns]
        _save_synced(local, changed)
    return True


def _download(fs: Any, src: str, dst: Path) -> None:
    """Stream one object into ``dst`` in ``PULL_CHUNK`` pieces through a temporary file renamed into place."""
    with fs.open_input_stream(src) as stream, atomic(dst) as tmp, open(tmp, "wb") as out:
        while chunk := stream.read(PULL_CHUNK):
            out.write(chunk)


def fetch(folder: Path | str, rels: list[str]) -> int:
    """Download the named files of a mirror folder that are not here yet, each by its own name: no listing of
    the folder's storage (``refresh`` lists it all, a LIST per call that grows with the folder: a learner step
    whose images rollout actors on other nodes published would list every image of the run). Returns how many
    it downloaded; a name stored nowhere is a ``DataError``."""
    folder = Path(folder)
    uri = location(folder)
    if uri == str(folder):
        return 0
    fs, path = open_root(uri)
    changed: dict[str, list[int]] = {}
    for rel in rels:
        dst = folder / rel
        if dst.is_file():
            continue
        info = fs.get_file_info(f"{path}/{rel}")  # one HEAD
        if info.type.name != "File":
            raise DataError(f"{join(uri, rel)}: not in storage (a file this run should have published)")
        _download(fs, info.path, dst)
        changed[rel], changed["@" + rel] = _stat(dst), [info.size, int(info.mtime_ns or 0)]
    _save_synced(folder, changed)
    return len(changed) // 2


def mirror(uri: str) -> Path:
    """The local mirror of ``uri``, filled from storage and marked with the URI it publishes to."""
    local = mirror_dir(uri)
    pull(uri, local)
    local.mkdir(parents=True, exist_ok=True)
    (local / MARKER).write_text(uri)
    return local


def attach(where: str | Path) -> Path:
    """The local folder for a ``location``: the (filled) mirror of a remote URI, else the path itself.
    Ray tasks and actors get a folder's location, not its path, because they may run on a node
    where the driver's mirror does not exist."""
    where = str(where)
    if is_remote(where):
        return mirror(where)
    return Path(where.removeprefix("file://"))


def refresh(folder: Path) -> None:
    """Pull into a mirror what other nodes published to its storage since (no-op for a local folder)."""
    uri = location(folder)
    if uri != str(folder):
        pull(uri, folder)


def location(folder: Path | str) -> str:
    """Where ``folder``'s contents live: its URI when it is (inside) a mirror, else the folder itself."""
    p = Path(folder)
    for top in (p, *p.parents):
        if (top / MARKER).is_file():
            uri = (top / MARKER).read_text().strip()
            return join(uri, p.relative_to(top).as_posix()) if top != p else uri
    return str(folder)


def publish(folder: Path | str, *subpaths: str) -> None:
    """Upload what changed in a mirror folder (or in ``subpaths`` of it) to the storage it mirrors;
    a no-op for a local run.

    An object store writes each file whole (at close), so a reader sees the old or the new
    version of a file, never half of one; jobs publish a "finished" marker (report, shard
    record) only after the data it vouches for.
    """
    folder = Path(folder)
    uri = location(folder)
    if uri == str(folder):
        return
    fs, path = open_root(uri)
    synced, changed = _synced(folder), {}
    sources = [folder / s for s in subpaths] if subpaths else [folder]
    for src in sources:
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(folder).as_posix()
            # files being written (``*.tmp``, or inside a ``*.tmp`` folder) are never uploaded
            if f.name in (MARKER, SYNCED, PULL_LOCK) or any(p.endswith(".tmp") for p in rel.split("/")) \
                    or synced.get(rel) == _stat(f):
                continue
            pafs.copy_files(str(f), f"{path}/{rel}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
            info = fs.get_file_info(f"{path}/{rel}")  # so that a later pull knows this copy is current
            changed[rel], changed["@" + rel] = _stat(f), [info.size, int(info.mtime_ns or 0)]
    _save_synced(folder, changed)


def train_storage(folder: Path | str) -> tuple[str, Any]:
    """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``: the remote folder a mirror
    publishes to (checkpoints go there directly, from every node), else the local folder."""
    uri = location(folder)
    if not is_remote(uri):
        return str(Path(uri.removeprefix("file://")).resolve()), None
    fs, path = open_root(uri)
    return path, fs


# Single objects and folders at a location (a local path or a URI), for writers that cannot go through a mirror's
# ``publish``/``pull`` (one file of a folder that other nodes fill too, a folder that must arrive whole):
# osvl/rl/checkpoint.py uploads each learner rank's own checkpoint files with them.

def _at(where: str) -> tuple[Any, str]:
    """``(filesystem, path)`` for a location; a bucket is opened and checked once per process (``open_root``),
    not once per object."""
    where = str(where)
    if not is_uri(where):
        return pafs.LocalFileSystem(), str(Path(where).resolve())
    parsed = urlparse(where)
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), parsed.path
    fs, bucket = open_root(f"{parsed.scheme}://{parsed.netloc}")
    return fs, f"{bucket}/{parsed.path.strip('/')}".rstrip("/")


def exists(where: str) -> bool:
    """Whether a file or folder is stored at ``where``."""
    fs, path = _at(where)
    return fs.get_file_info(path).type.name != "NotFound"


def listdir(where: str) -> list[str]:
    """The names directly under the folder at ``where`` (files and folders), sorted; [] when there is none."""
    fs, path = _at(where)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    return sorted(i.path.rstrip("/").rpartition("/")[2] for i in infos)


def read_text(where: str) -> str | None:
    """The small text object at ``where``, or None when nothing is stored there (read by name: no LIST)."""
    fs, path = _at(where)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except (FileNotFoundError, OSError):
        return None


class UploadQueue:
    """Tasks (callables that upload) run one after another on a background thread, at most ``max_pending``
    waiting: ``submit`` returns at once unless the queue is full, then it waits for room, so a producer
    (the learner saving checkpoints) runs ahead of its uploads by a bounded amount. The first error a task
    raises is raised again by the next ``submit`` or ``wait``: an upload that failed is never taken as done."""

    def __init__(self, max_pending: int = 1) -> None:
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="osvl-uploads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is not None and self._error is None:
                    task()
            except BaseException as e:  # noqa: BLE001 - kept and raised in the producer's thread
                self._error = e
            finally:
                self._tasks.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise StorageError(f"a background upload failed: {err}") from err

    def submit(self, task: Callable[[], None]) -> None:
        self._raise()
        self._tasks.put(task)

    def wait(self) -> None:
        """Block until every submitted task has run; raise the first error one raised."""
        self._tasks.join()
        self._raise()


def upload(local: Path | str, where: str) -> None:
    """Copy the local file ``local`` to ``where`` (an object store writes it whole, at close)."""
    fs, path = _at(where)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download(where: str, local: Path | str) -> bool:
    """Copy the file or folder at ``where`` to ``local`` (a folder: everything under it); False when nothing is
    stored there. No mirror record is kept: callers download into a temporary name and rename it into place."""
    fs, path = _at(where)
    if fs.get_file_info(path).type.name == "NotFound":
        return False
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(path, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return True


def delete(where: str) -> None:
    """Remove the file or folder at ``where`` (a folder with everything under it); nothing stored there is fine."""
    fs, path = _at(where)
    kind = fs.get_file_info(path).type.name
    if kind == "Directory":
        fs.delete_dir(path)
    elif kind == "File":
        fs.delete_file(path)
