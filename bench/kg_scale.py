"""Synthesis over a KG of millions of entities: what the graph costs a node, and whether workers still scale.

Every synthesis worker (``pipeline.ShardWorker``) and the driver open the KG through ``walks.Graph``,
which maps the graph compiled once per node (``osvl.kg.compiled``). This bench generates a synthetic
KG (``--entities``, ``--links``; a few hundred grounded seeds with small PNG photos), cached under
``cache_root()/bench-kg`` so that reruns reuse it, and runs synthesis over it with 1 and with 2
workers (fresh run names, the same ``--seeds``), measuring:

- ``pss_kg_mib``: the memory the KG adds on the node, summed over the worker processes: each worker's
  proportional set size (``Pss`` of ``/proc/self/smaps_rollup``: a page shared by two processes
  counts half in each) after it opened the graph and planned the splits, minus before. All workers
  measure at one moment (they wait for each other first), so the sharing is counted as it is;
  acceptance: with 2 workers at most 1.2x the figure with 1;
- ``driver_peak_mib``: the driver's peak RSS (this process: compiling the graph, planning, finalizing;
  the KG is generated in a child process); acceptance: at most 2 GiB. It covers the compile only when
  this run compiled (``first_open_s`` of seconds, not ~0: the compiled folder is cached per node);
- ``ratio``: questions per second with 2 workers over 1 (whole jobs: Ray start of the actors, the
  graph opening and split planning in each, every shard, finalize).

and, first, ``jobs/build_kg.py`` on a generated Wikidata triples file of ``--triples_gib`` (entity and
property URIs as the Query Service writes them, hub-skewed objects, a label table with aliases; cached
beside the KG), in a process of its own:

- ``build.driver_peak_gib``: that process's peak RSS (Ray's workers are not its children); acceptance: at
  most 2 GiB for a file of at least 1 GB (the former build held every parsed record: 1.46 GiB for 60 MB).

    .venv/bin/python bench/kg_scale.py [--entities=2000000] [--links=20000000] [--seeds=300] [--triples_gib=1.0]

Last stdout line: one JSON object. The KG is random (uniform links, no hubs), so walk success and
questions per seed say nothing about a real KG; the figures are about memory and scaling only.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.synth.pipeline import ShardWorker  # noqa: E402

CHUNK = 1_000_000
RELATIONS = ["linked_to"] * 14 + ["country", "author", "genre", "located in", "part of", "material"]


def pss_kib(pid: int | str = "self") -> int:
    """Proportional set size of a process, KiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise RuntimeError("no Pss line")


def generate(root: Path, n: int, n_links: int, n_seeds: int) -> None:
    """Write a random KG folder of ``n`` entities and ``n_links`` links in chunks (a few hundred MiB at a time)."""
    import cv2
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from osvl.kg.schema import ANCHORS_SCHEMA, ENTITIES_SCHEMA, LINKS_SCHEMA

    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    in_degree, out_degree = np.zeros(n, np.int64), np.zeros(n, np.int64)
    with pq.ParquetWriter(tmp / "links.parquet", LINKS_SCHEMA, compression="zstd") as w:
        for a in range(0, n_links, CHUNK):
            m = min(CHUNK, n_links - a)
            src = (np.arange(a, a + m) * n // n_links).astype(np.int64)  # about n_links / n links per entity
            dst = (src + 1 + rng.integers(0, n - 1, m)) % n  # never a self-loop
            rel = pa.DictionaryArray.from_arrays(rng.integers(0, len(RELATIONS), m).astype(np.int32),
                                                 pa.array(RELATIONS)).cast(pa.string())
            in_degree += np.bincount(dst, minlength=n)
            out_degree += np.bincount(src, minlength=n)
            w.write_table(pa.table({"src": src, "dst": dst, "relation": rel}, schema=LINKS_SCHEMA))
    attr_type = ENTITIES_SCHEMA.field("attributes").type.value_type
    with pq.ParquetWriter(tmp / "entities.parquet", ENTITIES_SCHEMA, compression="zstd") as w:
        for a in range(0, n, CHUNK):
            ids = np.arange(a, min(a + CHUNK, n))
            m = len(ids)
            strs = lambda fmt, xs: pa.array([fmt.format(x) for x in xs.tolist()], pa.string())  # noqa: E731
            keys = pa.array(np.tile(["Colour", "Code"], m).tolist(), pa.string())
            values = pa.array([v for x in ids.tolist() for v in (f"hue {x % 20011}", f"C-{x}")], pa.string())
            attrs = pa.StructArray.from_arrays(
                [keys, values, pa.array([""] * 2 * m), pa.array([True] * 2 * m)], fields=list(attr_type))
            empty = pa.ListArray.from_arrays(pa.array(np.zeros(m + 1, np.int32)), pa.array([], pa.string()))
            w.write_table(pa.table({
                "id": ids, "title": strs("Entity {}", ids), "aliases": empty, "description": strs("thing {}", ids % 97),
                "text": pa.array([""] * m), "attributes": pa.ListArray.from_arrays(
                    pa.array(np.arange(0, 2 * m + 1, 2, dtype=np.int32)), attrs),
                "images": empty, "categories": pa.ListArray.from_arrays(
                    pa.array(np.arange(m + 1, dtype=np.int32)), strs("subject.Group_{}", ids % 50)),
                "in_degree": in_degree[ids].astype(np.int32), "out_degree": out_degree[ids].astype(np.int32),
                "kind": pa.array(["article"] * m), "origin": pa.array(["wikidata"] * m)}, schema=ENTITIES_SCHEMA))
    seeds = np.linspace(0, n - 1, n_seeds).astype(np.int64)
    names = [f"seed_{s}.png" for s in seeds.tolist()]
    for name in names:  # as tests/test_wikidata.py's write_photos: small smooth photos and a licence README
        img = cv2.GaussianBlur(rng.integers(0, 255, size=(64, 64, 3), dtype=np.uint8), (0, 0), 3)
        cv2.imwrite(str(tmp / "images" / name), img)
    (tmp / "images" / "README").write_text("Files: " + "\n ".join(names) + "\nCopyright: the bench\nLicense: CC0-1.0\n")
    pq.write_table(pa.table({"entity_id": seeds, "image": names, "caption": [f"Entity {s}" for s in seeds.tolist()],
                             "source": ["bench"] * n_seeds, "licence": ["CC0-1.0"] * n_seeds,
                             "score": np.ones(n_seeds, np.float32), "scorer": ["bench"] * n_seeds},
                            schema=ANCHORS_SCHEMA), tmp / "anchors.parquet")
    os.rename(tmp, root)


class MeasuredWorker(ShardWorker):
    """``ShardWorker`` reporting its Pss before and after opening the graph; all workers measure together."""

    report_dir = ""
    workers = 1

    def __init__(self, cfg, out_dir: str, job: str):
        gc.collect()
        before = pss_kib()
        super().__init__(cfg, out_dir, job)
        report = Path(self.report_dir)
        (report / f"{os.getpid()}.loaded").touch()
        deadline = time.time() + 600
        while len(list(report.glob("*.loaded"))) < self.workers and time.time() < deadline:
            time.sleep(0.05)  # the others are still opening: measure when every worker holds its graph
        time.sleep(0.5)
        gc.collect()
        after = pss_kib()
        (report / f"{os.getpid()}.json").write_text(json.dumps({"before_kib": before, "after_kib": after}))


def measure_synthesis(kg: Path, n_seeds: int, num_shards: int) -> dict:
    """Synthesis over ``kg`` with 1 then 2 workers: KG memory of the workers, questions/s, the driver's peak."""
    from osvl.cluster import init_ray
    from osvl.config import apply_override
    from osvl.synth import job
    from osvl.synth.job import SynthConfig, run
    from osvl.synth.walks import Graph

    t0 = time.perf_counter()
    Graph.load(kg)  # compiles, unless a previous run of this bench did; the runs below only open it
    open_s = time.perf_counter() - t0
    print(f"  graph compiled (or found) and opened in {open_s:.1f} s", flush=True)
    one_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                    "OPENCV_FOR_THREADS_NUM")}
    init_ray(num_cpus=2, runtime_env={"env_vars": one_thread})
    job.ShardWorker = MeasuredWorker
    out = {"first_open_s": round(open_s, 1)}
    with tempfile.TemporaryDirectory(prefix="osvl-bench-kg-") as tmp:
        for workers in (1, 2):
            report = Path(tmp) / f"report{workers}"
            report.mkdir()
            MeasuredWorker.report_dir, MeasuredWorker.workers = str(report), workers
            cfg = SynthConfig()
            for key, value in (("kg_dir", kg), ("workers", workers), ("num_shards", num_shards),
                               ("run.root", Path(tmp) / "runs"), ("run.name", f"w{workers}")):
                cfg = apply_override(cfg, key, str(value))
            t0 = time.perf_counter()
            _, card = run(cfg, log=lambda _msg: None)
            seconds = time.perf_counter() - t0
            rows = [json.loads(p.read_text()) for p in report.glob("*.json")]
            kg_kib = sum(r["after_kib"] - r["before_kib"] for r in rows)
            out[f"workers_{workers}"] = {
                "questions": card["questions"], "seconds": round(seconds, 1),
                "questions_per_s": round(card["questions"] / seconds, 2), "pss_kg_mib": round(kg_kib / 1024, 1),
                "pss_per_worker_mib": [round((r["after_kib"] - r["before_kib"]) / 1024, 1) for r in rows],
                "pss_worker_before_mib": [round(r["before_kib"] / 1024, 1) for r in rows]}
            print(f"  workers={workers}: {card['questions']} questions in {seconds:.1f} s; KG adds "
                  f"{kg_kib / 1024:.1f} MiB Pss over {len(rows)} worker(s)", flush=True)
    w1, w2 = out["workers_1"], out["workers_2"]
    out["pss_2_over_1"] = round(w2["pss_kg_mib"] / max(w1["pss_kg_mib"], 1e-9), 3)
    out["ratio"] = round(w2["questions_per_s"] / w1["questions_per_s"], 3)
    out["driver_peak_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["seeds"], out["num_shards"] = n_seeds, num_shards
    return out


PROPS = ["P17", "P19", "P27", "P106", "P131", "P361", "P31", "P1082", "P569", "P2044"]
LITERAL = {"P1082", "P569", "P2044"}
URI_E, URI_P = "http://www.wikidata.org/entity/", "http://www.wikidata.org/prop/direct/"


def write_triples(folder: Path, n: int, gib: float) -> tuple[Path, Path]:
    """Query-Service-style triples over ``n`` items (objects Pareto-skewed onto a few hubs) until the file holds
    ``gib`` GiB, and the label table (``id, label, description, aliases``); kept for reruns."""
    import numpy as np

    triples, labels = folder / "triples.tsv", folder / "labels.tsv"
    if triples.is_file() and labels.is_file():
        return triples, labels
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(labels.with_suffix(".tmp"), "w") as f:
        f.write("id\tlabel\tdescription\taliases\n")
        for lo in range(0, n, CHUNK):
            f.write("".join(f"Q{i}\tThing {i}\tmade-up item number {i}\tT{i}|Item {i}\n"
                            for i in range(lo, min(n, lo + CHUNK))))
        f.write("".join(f"{p}\tproperty {p[1:]}\t\n" for p in PROPS))
    written = 0
    with open(triples.with_suffix(".tmp"), "w") as f:
        f.write("subject\tproperty\tobject\n")
        while written < gib * 2**30:
            m = 200_000
            s_, p_ = rng.integers(0, n, m).tolist(), rng.integers(0, len(PROPS), m).tolist()
            o_ = np.minimum((rng.pareto(1.2, m) * 50).astype(np.int64), n - 1).tolist()
            v_ = rng.integers(1, 10**7, m).tolist()
            chunk = "".join(f"{URI_E}Q{s}\t{URI_P}{PROPS[p]}\t{v if PROPS[p] in LITERAL else f'{URI_E}Q{o}'}\n"
                            for s, p, o, v in zip(s_, p_, o_, v_, strict=True))
            f.write(chunk)
            written += len(chunk)
    os.rename(labels.with_suffix(".tmp"), labels)
    os.rename(triples.with_suffix(".tmp"), triples)
    return triples, labels


def measure_build(folder: Path, n: int, gib: float) -> dict:
    """``jobs/build_kg.py`` on a ``gib`` GiB triples file in a process of its own: wall time, the driver's peak RSS."""
    import subprocess

    triples, labels = write_triples(folder, n, gib)
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="osvl-bench-build-") as tmp:
        runner = ("import json, resource, runpy, sys, time; t = time.perf_counter(); "
                  f"sys.argv = ['build_kg', '--input={triples}', '--labels={labels}', '--run.root={tmp}', "
                  "'--run.name=b']; runpy.run_path('jobs/build_kg.py', run_name='__main__'); "
                  "print('PEAK', json.dumps({'driver_peak_gib': round(resource.getrusage(resource.RUSAGE_SELF)"
                  ".ru_maxrss / 2**20, 3), 'seconds': round(time.perf_counter() - t, 1)}))")
        proc = subprocess.run([sys.executable, "-c", runner], cwd=repo, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"build_kg failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        res = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PEAK")).split(" ", 1)[1])
        counts = json.loads((Path(tmp) / "build_kg" / "b" / "counts.json").read_text())
    out = {"triples_gib": round(triples.stat().st_size / 2**30, 3), **res, "entities": counts["entities"],
           "links": counts["links"], "bad_lines": counts["bad_lines"]}
    print(f"  build_kg: {out['triples_gib']} GiB of triples -> {out['entities']:,} entities, {out['links']:,} links "
          f"in {out['seconds']} s, driver peak {out['driver_peak_gib']} GiB", flush=True)
    return out


def main() -> None:
    from osvl.config import script_flags
    from osvl.storage import cache_root

    flag, _ = script_flags(sys.argv[1:], {"entities": 2_000_000, "links": 20_000_000, "seeds": 300, "shards": 8,
                                          "triples_gib": 1.0})
    t0 = time.perf_counter()
    kg = cache_root() / "bench-kg" / f"e{flag['entities']}-l{flag['links']}-s{flag['seeds']}-v1"
    if not kg.is_dir():
        print(f"generating {flag['entities']:,} entities, {flag['links']:,} links -> {kg}", flush=True)
        kg.parent.mkdir(parents=True, exist_ok=True)
        # in a child process: the driver's peak below is the driver's, not the generator's
        child = multiprocessing.get_context("spawn").Process(
            target=generate, args=(kg, flag["entities"], flag["links"], flag["seeds"]))
        child.start()
        child.join()
        if child.exitcode:
            raise SystemExit(f"generating the KG failed ({child.exitcode})")
    print(f"KG ready in {time.perf_counter() - t0:.1f} s: {kg}", flush=True)
    result = {"entities": flag["entities"], "links": flag["links"]}
    # first, before this process starts Ray: the build runs its own driver, measured alone
    result["build"] = measure_build(kg.parent / f"triples-e{flag['entities']}-g{flag['triples_gib']}",
                                    flag["entities"], float(flag["triples_gib"]))
    result.update(measure_synthesis(kg, flag["seeds"], flag["shards"]))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
