"""A MediaWiki ``pages-articles`` dump -> KG Parquet tables, with Ray Data (``jobs/build_kg.py``).

(Wikidata input, ``--format=wikidata_json|wikidata_triples``, goes through ``osvl.kg.wikidata``
instead; the job's ``run``, ``osvl.kg.job``, dispatches on the format.)

Two passes:

1. **Parse (parallel).** The driver streams the .bz2 with ``mediawiki.iter_page_fields``
   and cuts the page stream into shards of ``shard_pages`` pages (shard k = pages
   ``[k*n, (k+1)*n)`` of the stream, so shard boundaries are the same on every run).
   ``workers`` shards at a time become one ``ray.data.from_items`` dataset, one shard per
   block; ``map_batches`` runs ``parse_page`` on every page of a shard on a worker, which
   writes the shard atomically (``.tmp`` + rename) as ``shards/NNNNNN.parquet`` and
   returns its counts. The driver reads the next wave while the current one runs (one
   background thread), so it holds at most two waves of raw pages: memory is bounded by
   ``2 * workers * shard_pages`` pages whatever the size of the dump.
   Why the driver reads at all: a ``.bz2`` stream cannot be split without the
   multistream index, and one reader keeps page order (hence ids) deterministic.
   A page that does not validate or that ``parse_page`` cannot handle is skipped and
   counted, never fatal; the counts live in each shard's Parquet metadata, so a rerun
   that skips finished shards still reports the totals.
2. **Resolve (bounded).** Read the shards' titles back in order: namespace-0 redirects become
   aliases of their targets, links are resolved through the redirect table exactly as
   ``mediawiki.load`` does (same ids, same edges). The title maps are Arrow arrays (a Python
   string lives only while it is folded); then each shard is read whole alone, its links resolved
   against them, and written as a part that ``schema.write_kg_parts`` (``write_kg``'s rules over
   parts) turns into the tables. No article's text or links outlive their shard, so the driver
   holds the title maps and two degree arrays, not the dump.

Resume re-streams the .bz2 from the start (a bz2 stream has no random access) but hands no
page of a finished shard to Ray. Malformed XML (not a malformed page) stops the job with
``DataError``: past a syntax error the stream has no next page; shards written so far stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl.errors import ConfigError, DataError
from osvl.kg.mediawiki import iter_page_fields, page_from_fields, parse_page
from osvl.kg.schema import ATTRIBUTE_TYPE, fold_all
from osvl.logs import Progress
from osvl.storage import atomic

logger = logging.getLogger(__name__)

MAX_BAD_EXAMPLES = 5
STATS_KEY = b"osvl_stats"

SHARD_SCHEMA = pa.schema([
    ("title", pa.string()),
    ("redirect", pa.string()),
    ("text", pa.string()),
    ("attributes", pa.list_(pa.struct([("key", pa.string()), ("value", pa.string()), ("source", pa.string())]))),
    ("links", pa.list_(pa.struct([("target", pa.string()), ("relation", pa.string())]))),
    ("images", pa.list_(pa.string())),
    ("categories", pa.list_(pa.string())),
    ("kind", pa.string()),
])
"""One row per namespace-0 page of a shard, in stream order; redirects have ``redirect`` set and nothing else."""


def shard_path(shard_dir: Path, k: int) -> Path:
    return shard_dir / f"{k:06d}.parquet"


def check_same_input(path: Path, shard_dir: Path) -> None:
    """Resume only over the same export: the config hash sees the path, not the bytes behind it."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))  # size + first MiB: cheap, and a new dump differs in both
    stamp, fingerprint = shard_dir / "input.sha256", digest.hexdigest()
    shard_dir.mkdir(parents=True, exist_ok=True)
    if stamp.is_file() and stamp.read_text().strip() != fingerprint:
        raise ConfigError(f"{shard_dir} holds shards of another export; pick a new --run.name or delete it")
    stamp.write_text(fingerprint + "\n")


def parse_shard(pages: list[dict[str, str]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Parse one shard's raw pages: namespace-0 rows in order, and counts (bad pages skipped)."""
    rows: list[dict[str, Any]] = []
    stats: dict[str, Any] = {"pages": len(pages), "articles": 0, "redirects": 0, "other_ns": 0, "bad": 0,
                             "bad_examples": []}
    for fields in pages:
        try:
            page = page_from_fields(fields)
            if page.ns != 0:
                stats["other_ns"] += 1
                continue
            row = parse_page(page)
        except Exception as e:  # noqa: BLE001 - any failure on one page must skip that page, not the job
            stats["bad"] += 1
            if len(stats["bad_examples"]) < MAX_BAD_EXAMPLES:
                stats["bad_examples"].append(f"{fields.get('title', '')!r}: {type(e).__name__}: {e}"[:300])
            continue
        stats["redirects" if page.redirect else "articles"] += 1
        row["links"] = [{"target": t, "relation": r} for t, r in row["links"]]
        rows.append(row)
    return rows, stats


def write_shard(path: Path, rows: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Atomic: a reader (or a resumed run) sees the whole shard or none of it."""
    table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)
    table = table.replace_schema_metadata({STATS_KEY: json.dumps(stats).encode()})
    with atomic(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_stats(path: Path) -> dict[str, Any]:
    meta = pq.read_schema(path).metadata or {}
    if STATS_KEY not in meta:
        raise DataError(f"{path} has no shard counts: not a shard of osvl.kg.dump; delete it to rebuild")
    return json.loads(meta[STATS_KEY])


def parse_batch(batch: pa.Table, shard_dir: str) -> pa.Table:
    """Ray Data ``map_batches`` function: each row is one shard ``{shard, pages}``; writes it, returns counts."""
    out = {"shard": [], "stats": []}
    for item in batch.to_pylist():
        t0 = time.perf_counter()
        rows, stats = parse_shard(item["pages"])
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        write_shard(shard_path(Path(shard_dir), item["shard"]), rows, stats)
        out["shard"].append(item["shard"])
        out["stats"].append(json.dumps(stats))
    return pa.table(out)


def iter_waves(path: Path, shard_pages: int, wave: int, done: set[int]) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Yield (shards to parse, pages streamed so far): up to ``wave`` shards not in ``done``, in order.

    Finished shards are streamed past without being kept: the bz2 must still be read to
    find where the next shard starts, but nothing of a finished shard reaches Ray.
    """
    items: list[dict[str, Any]] = []
    pages: list[dict[str, str]] = []
    k = n = 0
    for fields in iter_page_fields(path):
        n += 1
        if k not in done:
            pages.append(fields)
        if n % shard_pages == 0:
            if k not in done:
                items.append({"shard": k, "pages": pages})
            pages, k = [], k + 1
            if len(items) >= wave:
                yield items, n
                items = []
    if pages:
        items.append({"shard": k, "pages": pages})
    if items:
        yield items, n


def run_wave(items: list[dict[str, Any]], shard_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/build_kg.py --help

    ray.data.DataContext.get_current().enable_progress_bars = False  # the job prints one line per shard
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(parse_batch, batch_size=1, batch_format="pyarrow", num_cpus=1,
                        fn_kwargs={"shard_dir": str(shard_dir)})
    return [(int(r["shard"]), json.loads(r["stats"])) for r in ds.iter_rows()]


def parse_dump(path: Path, shard_dir: Path, shard_pages: int, workers: int, log: Callable[[str], None]) -> int:
    """Pass 1; returns how many shards were parsed in this run (the rest were already on disk)."""
    done = {int(p.stem) for p in shard_dir.glob("[0-9]*.parquet")}
    if done:
        log(f"build_kg: {len(done)} shards already written in {shard_dir}; they are skipped")
    parsed, t0 = 0, time.perf_counter()
    pending: Future | None = None
    # the stream's length is unknown until its end: the bar counts shards
    with ThreadPoolExecutor(max_workers=1) as pool, Progress(None, "build_kg", "shards", initial=len(done)) as bar:
        for items, streamed in iter_waves(path, shard_pages, workers, done):  # one wave runs while the next is read
            if pending is not None:
                parsed += _report(pending.result(), log, t0, bar)
            log(f"build_kg: read {streamed} pages; parsing shards {items[0]['shard']}..{items[-1]['shard']}")
            pending = pool.submit(run_wave, items, shard_dir)
        if pending is not None:
            parsed += _report(pending.result(), log, t0, bar)
    return parsed


def _report(results: list[tuple[int, dict[str, Any]]], log: Callable[[str], None], t0: float,
            bar: Progress) -> int:
    for k, s in sorted(results):
        log(f"  shard {k:6d}: {s['pages']} pages, {s['articles']} articles, {s['redirects']} redirects, "
            f"{s['bad']} bad, {s['seconds']} s (t={time.perf_counter() - t0:.1f} s)")
    bar.update(len(results), pages=sum(s["pages"] for _, s in results))
    return len(results)


def _last_wins(keys: pa.Array, values: pa.Array) -> tuple[pa.Array, pa.Array]:
    """A dict built in order from ``keys`` and ``values`` (a later key overwrites an earlier one), as two Arrow
    arrays: the distinct keys, and each one's last value; looked up with ``pc.index_in``."""
    if not len(keys):
        return keys, values
    rev = pa.array(np.arange(len(keys) - 1, -1, -1))
    keys_rev = keys.take(rev)
    distinct = pc.unique(keys_rev)  # first in reverse order: the last in order
    return distinct, values.take(rev).take(pc.index_in(distinct, value_set=keys_rev))


def _folded(values: list[str]) -> pa.Array:
    return pa.array(fold_all(values), pa.string())


def resolve(shard_dir: Path, tmp: Path) -> tuple[list[tuple[Path, Path]], dict[str, Any], int]:
    """Pass 2: entities and links from the shards, resolved as ``mediawiki.load`` resolves them, written as
    ``write_kg_parts`` parts (one per shard, an article's id its place among the articles) into ``tmp``;
    returns the parts, the totals and the number of aliases.

    First the titles alone (the article titles, the redirect table, the aliases: Arrow arrays, a Python
    string only while it is folded); then each shard alone, its links resolved against those arrays, so
    no article's text or links outlive their shard.
    """
    paths = sorted(shard_dir.glob("[0-9]*.parquet"), key=lambda p: int(p.stem))
    ks = [int(p.stem) for p in paths]
    if ks != list(range(len(ks))):
        raise DataError(f"{shard_dir}: shards {sorted(set(range(max(ks, default=-1) + 1)) - set(ks))} are missing")
    totals: dict[str, Any] = {"shards": len(paths), "pages": 0, "articles": 0, "redirects": 0, "other_ns": 0,
                              "bad": 0, "bad_examples": []}
    title_keys, alias_titles, alias_keys, redirect_targets = [], [], [], []
    for path in paths:
        stats = read_stats(path)
        for key in ("pages", "articles", "redirects", "other_ns", "bad"):
            totals[key] += stats[key]
        totals["bad_examples"] += stats["bad_examples"][: MAX_BAD_EXAMPLES - len(totals["bad_examples"])]
        t = pq.read_table(path, columns=["title", "redirect"])
        is_redirect = pc.fill_null(pc.not_equal(t.column("redirect"), ""), False)
        arts, reds = t.filter(pc.invert(is_redirect)), t.filter(is_redirect)
        title_keys.append(_folded(arts.column("title").to_pylist()))
        alias_titles.append(reds.column("title").combine_chunks())
        alias_keys.append(_folded(reds.column("title").to_pylist()))
        redirect_targets.append(reds.column("redirect").combine_chunks())
    concat = (lambda parts: pa.concat_arrays(parts) if parts else pa.array([], pa.string()))  # noqa: E731
    article_keys = concat(title_keys)
    id_keys, id_of = _last_wins(article_keys, pa.array(np.arange(len(article_keys)), pa.int64()))
    red_keys, red_target = _last_wins(concat(alias_keys), concat(redirect_targets))
    # every redirect title is an alias of the article its (last) target names
    alias_titles_all, alias_keys_all = concat(alias_titles), concat(alias_keys)
    target = _folded(pc.take(red_target, pc.index_in(alias_keys_all, value_set=red_keys)).to_pylist())
    alias_owner = pc.take(id_of, pc.index_in(target, value_set=id_keys))
    aliases = pa.table({"src": alias_owner, "k": pa.array(np.arange(len(alias_owner))), "alias": alias_titles_all})
    aliases = aliases.filter(pc.is_valid(alias_owner)).sort_by([("src", "ascending"), ("k", "ascending")])
    alias_src = aliases.column("src").to_numpy()
    del title_keys, alias_titles, alias_keys, redirect_targets, target, alias_owner

    parts, lo = [], 0
    for k, path in enumerate(paths):
        t = pq.read_table(path)
        t = t.filter(pc.invert(pc.fill_null(pc.not_equal(t.column("redirect"), ""), False)))
        n = t.num_rows
        a, b = np.searchsorted(alias_src, [lo, lo + n])
        own = aliases.slice(a, b - a)
        offsets = np.searchsorted(own.column("src").to_numpy(), np.arange(lo, lo + n + 1)).astype(np.int32)
        attrs = t.column("attributes").combine_chunks()
        flat = attrs.flatten()
        attr = pa.StructArray.from_arrays([pc.struct_field(flat, f) for f in ("key", "value", "source")]
                                          + [pa.nulls(len(flat), pa.bool_())], fields=list(ATTRIBUTE_TYPE))
        ent = pa.table({"id": pa.array(np.arange(lo, lo + n), pa.int64()), "title": t.column("title"),
                        "aliases": pa.ListArray.from_arrays(pa.array(offsets), own.column("alias").combine_chunks()),
                        "description": pa.array([""] * n), "text": t.column("text"),
                        "attributes": pa.ListArray.from_arrays(attrs.offsets, attr), "images": t.column("images"),
                        "categories": t.column("categories"), "in_degree": pa.array(np.zeros(n, np.int32)),
                        "out_degree": pa.array(np.zeros(n, np.int32)), "kind": t.column("kind"),
                        "origin": pa.array(["mediawiki"] * n)})
        links = t.column("links").combine_chunks()
        flat = links.flatten()
        src = pc.add(pc.list_parent_indices(links), lo).cast(pa.int64())
        key = _folded(pc.struct_field(flat, "target").to_pylist())
        direct = pc.index_in(key, value_set=id_keys)
        # not an article's title: one redirect hop, as MediaWiki does (and mediawiki.load)
        hop = _folded(pc.fill_null(pc.take(red_target, pc.index_in(key, value_set=red_keys)), "").to_pylist())
        dst = pc.take(id_of, pc.coalesce(direct, pc.index_in(hop, value_set=id_keys)))
        lk = pa.table({"src": src, "dst": dst, "relation": pc.struct_field(flat, "relation")})
        lk = lk.filter(pc.and_(pc.is_valid(dst), pc.not_equal(src, dst)))
        ent_file, link_file = tmp / f"entities-{k:06d}.parquet", tmp / f"links-{k:06d}.parquet"
        pq.write_table(ent, ent_file)
        pq.write_table(lk, link_file)
        parts.append((ent_file, link_file))
        lo += n
    return parts, totals, aliases.num_rows
