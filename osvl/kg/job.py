"""The build_kg job (``jobs/build_kg.py``): its config and ``run``, which dispatches on the input's format:
a MediaWiki dump goes through ``osvl.kg.dump`` (parse in Ray Data shards, then resolve), Wikidata through
``osvl.kg.wikidata``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from osvl.cluster import init_ray
from osvl.config import RunConfig, input_path, opt, run_dir
from osvl.errors import ConfigError
from osvl.kg import wikidata
from osvl.kg.dump import check_same_input, parse_dump, resolve
from osvl.kg.schema import write_kg_parts
from osvl.storage import atomic
from osvl.tracking import tracked

logger = logging.getLogger(__name__)

JOB = "build_kg"
SAMPLE_INPUT = "$OSVL_SHARED_DATA/mediawiki/enwiki-pages-articles-sample.xml.bz2"


@dataclasses.dataclass
class BuildKGConfig:
    run: RunConfig = opt(RunConfig, "Run root and global seed.")
    input: str = opt(SAMPLE_INPUT, "MediaWiki pages-articles export (.xml or .xml.bz2), or Wikidata: a JSON dump "
                     "(.json/.jsonl[.bz2|.gz]) or a triples file (.tsv/.csv), see --format; relative paths are "
                     "relative to the repo root. Default: the shared 2016 sample (106 articles, 99 redirects).")
    shard_pages: int = opt(20, "Pages (of any namespace, redirects included) per shard: the unit of work "
                           "and of resume.")
    workers: int = opt(2, "Shards parsed at once (one Ray Data block and one CPU each); also the wave size "
                       "the driver reads ahead.", hashed=False)
    out_dir: str = opt("", "Also copy the KG tables here when set (e.g. a folder every node can read).",
                       hashed=False)
    format: Literal["auto", "mediawiki", "wikidata_json", "wikidata_triples"] = opt(
                      "auto", "Input format: mediawiki (pages-articles XML); wikidata_json (the Wikidata JSON "
                      "dump: a JSON array or JSON Lines of entities with labels, aliases, descriptions, claims); "
                      "wikidata_triples (subject, property, object rows, tab-separated for .tsv else commas, "
                      "ids named by --labels); auto: .xml[.bz2] -> mediawiki, .json/.jsonl[.bz2|.gz] -> "
                      "wikidata_json, .tsv/.csv[.gz] -> wikidata_triples.")
    labels: str = opt("", "wikidata_triples: label table with rows id, label[, description] for items (Q42) and "
                      "properties (P19); common property labels are built in.")
    images_dir: str = opt("", "wikidata_*: folder of photos named as in the P18 (image) claims; each found one "
                          "becomes an anchor, its licence read from the folder's Debian-copyright-style README.")
    language: str = opt("en", "wikidata_json: language of the labels, aliases and descriptions read.")


def input_format(cfg: BuildKGConfig, path: Path) -> str:
    """``cfg.format``, or for ``auto`` the one the file name says (compression suffixes ignored)."""
    if cfg.format != "auto":
        if cfg.format not in ("mediawiki", *wikidata.FORMATS):
            raise ConfigError(f"format must be auto, mediawiki, {', '.join(wikidata.FORMATS)}; got {cfg.format!r}")
        return cfg.format
    suffixes = [s for s in path.suffixes if s not in (".bz2", ".gz")]
    kind = {".xml": "mediawiki", ".json": "wikidata_json", ".jsonl": "wikidata_json", ".tsv": "wikidata_triples",
            ".csv": "wikidata_triples"}.get(suffixes[-1] if suffixes else "")
    if kind is None:
        raise ConfigError(f"cannot tell the format of {path.name}; pass --format=mediawiki|wikidata_json|"
                          "wikidata_triples")
    return kind


def validate(cfg: BuildKGConfig) -> Path:
    """Checks the config; returns the input path (resolved against the repo root)."""
    if cfg.shard_pages < 1 or cfg.workers < 1:
        raise ConfigError(f"shard_pages and workers must be >= 1, got {cfg.shard_pages}, {cfg.workers}")
    if not cfg.input:
        raise ConfigError("set --input=PATH to a pages-articles export (.xml.bz2); see docs/data.md for the full dump")
    path = input_path(cfg.input)
    if not path.is_file():
        raise ConfigError(f"input {cfg.input!r} does not exist ({path}); download the dump first (docs/data.md)")
    for name in ("labels", "images_dir"):
        value = getattr(cfg, name)
        if value and not input_path(value).exists():
            raise ConfigError(f"{name} {value!r} does not exist ({input_path(value)})")
    return path


def _copy_out(kg_dir: Path, out_dir: str) -> None:
    """Copy the tables (and the anchor photos, when there are any) to ``out_dir``; each file atomically."""
    if not out_dir:
        return
    dest = Path(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    names = ["entities.parquet", "links.parquet", "anchors.parquet"]
    if (kg_dir / "images").is_dir():
        (dest / "images").mkdir(exist_ok=True)
        names += [f"images/{p.name}" for p in sorted((kg_dir / "images").iterdir())]
    for name in names:
        with atomic(dest / name) as tmp:  # copied in chunks: a KG of millions of entities is gigabytes
            shutil.copyfile(kg_dir / name, tmp)


@tracked(JOB)
def run(cfg: BuildKGConfig, *, log: Callable[[str], None] = logger.info) -> tuple[Path, dict[str, Any]]:
    """Both passes; returns the KG folder and the counts (also saved as ``counts.json``)."""
    path = validate(cfg)
    fmt = input_format(cfg, path)
    out = run_dir(cfg, JOB)
    shard_dir, kg_dir = out / "shards", out / "kg"
    if fmt != "mediawiki":
        t0 = time.perf_counter()
        log(f"build_kg: {path} ({fmt}) -> {out}")
        init_ray()
        report = wikidata.build(path, fmt, kg_dir, labels=input_path(cfg.labels) if cfg.labels else None,
                                images_dir=input_path(cfg.images_dir) if cfg.images_dir else None,
                                language=cfg.language, workers=cfg.workers, log=log)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "counts.json").write_text(json.dumps(report, indent=1))
        _copy_out(kg_dir, cfg.out_dir)
        log(f"build_kg: {report['entities']} entities, {report['links']} links, {report['anchors']} anchors; "
            f"{report['bad_lines']} bad lines skipped -> {kg_dir}")
        return kg_dir, report
    check_same_input(path, shard_dir)
    t0 = time.perf_counter()
    log(f"build_kg: {path} -> {out} ({cfg.shard_pages} pages per shard, {cfg.workers} at once)")
    init_ray()
    parsed = parse_dump(path, shard_dir, cfg.shard_pages, cfg.workers, log)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out, prefix=".resolve-") as tmp:
        parts, totals, n_aliases = resolve(shard_dir, Path(tmp))
        counts = write_kg_parts(kg_dir, parts)
    report = {**totals, "parsed_this_run": parsed, **counts, "aliases": n_aliases,
              "parse_seconds": round(t1 - t0, 1), "resolve_seconds": round(time.perf_counter() - t1, 1)}
    (out / "counts.json").write_text(json.dumps(report, indent=1))
    _copy_out(kg_dir, cfg.out_dir)
    log(f"build_kg: {report['entities']} entities, {report['aliases']} aliases, {report['links']} links; "
        f"{report['bad']} bad pages skipped; {parsed} shards parsed this run -> {kg_dir}")
    return kg_dir, report
