"""Multi-hop visual question synthesis as a resumable Ray Data job.

Stages, in order (each drops and counts by reason; the counts end up in the data card):

1. **plan** (driver and every worker, deterministic): seeds are the entities with a
   grounded anchor image; every entity gets one split (``walks.assign_splits``), and
   seeds are dealt round-robin into ``num_shards`` shards.
2. **synthesize** (Ray Data ``map_batches`` over shard numbers, one actor per worker,
   each mapping the KG compiled once per node, ``osvl.kg.compiled``): per seed, sample ``h``,
   walk, rewrite, check the three invariants, deduplicate by path and answer, attach (and maybe degrade) an image;
   a seed stops after ``patience`` attempts in a row made nothing new, and a seed that
   made nothing is counted per split with its most frequent failure.
   Every shard has its own RNG seeded from ``(run.seed, shard)``, so a shard's rows
   do not depend on which worker ran it or when. A shard commits by renaming its
   Parquet file into ``shards/``; a rerun skips committed shards, which is the whole
   resume story (a killed shard left no file, and its images are named by content).
3. **difficulty filter** (slot, empty by default): ``filter.stage`` names a callable
   class ``module:Class`` applied as a Ray Data ``map_batches`` stage to the candidate
   rows (a ``pyarrow.Table`` batch in, the kept rows out). The agent issue fills it with
   the two-stage filter (solvable with tools, not without); its actors get
   ``filter.num_gpus`` each.
4. **finalize** (driver, deterministic): cap any one answer at ``max_answer_share`` and
   any one seed at ``max_seed_share`` of the questions, write ``sft``/``rl``/``heldout``
   Parquet files and the data card.

Output under ``<run root>/synthesize/<config hash>/``: ``{sft,rl,heldout}.parquet``,
``images/`` (each image once, named by content hash), ``data_card.{json,md}``,
``shards/`` (the resumable intermediate).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl import metrics as M
from osvl import storage
from osvl.cluster import role_resources
from osvl.config import config_hash
from osvl.errors import ConfigError
from osvl.logs import Progress
from osvl.synth.degrade import degrade
from osvl.synth.invariants import fold, violations
from osvl.synth.rewrite import Draft, llm_rewrite, template_rewrite
from osvl.synth.walks import SPLITS, Graph, SplitMap, WalkConfig, assign_splits, random_walk

if TYPE_CHECKING:
    from osvl.synth.job import SynthConfig

logger = logging.getLogger(__name__)


def plan(graph: Graph, cfg: SynthConfig) -> tuple[list[list[int]], SplitMap]:
    """Seeds dealt into shards, and every entity's split; the same on every worker."""
    seeds = graph.seeds(cfg.min_grounding_score)
    fractions = dict(zip(SPLITS, cfg.split_fractions, strict=False))  # three shares: no dev split
    entity_fractions = dict(zip(SPLITS, cfg.entity_split_fractions, strict=False))
    split_of = assign_splits(graph, seeds, fractions, entity_fractions, cfg.run.seed, cfg.walk.hub_in_degree,
                             depth=max(cfg.walk.hops))
    shards = [seeds[k::cfg.num_shards] for k in range(cfg.num_shards)]
    return shards, split_of


def split_titles(cfg: SynthConfig, *splits: str) -> set[str]:
    """Titles of every entity ``cfg`` puts in one of ``splits`` (seeds, bridges, answers' owners and all the rest:
    ``plan`` gives every entity of the KG one split), e.g. what a corpus must leave out to keep held-out clean."""
    graph = Graph.load(cfg.kg_dir or None, max_answer_words=cfg.walk.max_answer_words)
    _, split_of = plan(graph, cfg)
    return {graph.entities[i].title for i, s in split_of.items() if s in splits}


ROW_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("question", pa.string()),
    ("answer", pa.string()),
    ("answer_aliases", pa.list_(pa.string())),
    ("answer_key", pa.string()),
    ("images", pa.list_(pa.string())),
    ("path", pa.list_(pa.struct([("entity_id", pa.int64()), ("title", pa.string()), ("relation", pa.string()),
                                 ("descriptor_kind", pa.string()), ("descriptor_key", pa.string()),
                                 ("descriptor_value", pa.string())]))),
    ("hops", pa.int32()),
    ("degraded", pa.bool_()),
    ("degradation", pa.string()),  # JSON: kind, undo_tool and the parameters; "" when not degraded
    ("provenance", pa.struct([("kg", pa.string()), ("anchor_image", pa.string()), ("anchor_source", pa.string()),
                              ("caption", pa.string()), ("grounding_score", pa.float32()),
                              ("scorer", pa.string()), ("rewriter", pa.string()), ("shard", pa.int32())])),
    ("licence", pa.string()),
    ("split", pa.string()),
])


class ImageStore:
    """Writes each image once under ``images/``, named by the SHA-256 of its bytes."""

    def __init__(self, graph: Graph, out_dir: Path):
        self.graph, self.dir = graph, out_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._decoded: dict[str, np.ndarray] = {}

    def _put(self, data: bytes, ext: str) -> str:
        name = hashlib.sha256(data).hexdigest()[:24] + ext
        storage.write_once(self.dir / name, data)
        return name

    def _source(self, image: str) -> Path:
        if self.graph.root is None:
            raise FileNotFoundError(f"graph has no folder to read image {image!r} from")
        return self.graph.root / "images" / image

    def original(self, image: str) -> str:
        path = self._source(image)
        return self._put(path.read_bytes(), path.suffix.lower() or ".jpg")

    def degraded(self, image: str, kind: str, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        if image not in self._decoded:
            bgr = cv2.imread(str(self._source(image)), cv2.IMREAD_COLOR)
            if bgr is None:
                raise ValueError(f"cannot decode {image}")
            self._decoded[image] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        out, record = degrade(self._decoded[image], kind, rng)
        ok, buf = cv2.imencode(".png", cv2.cvtColor(out, cv2.COLOR_RGB2BGR))
        if not ok:
            raise ValueError(f"cannot encode degraded {image}")
        return self._put(buf.tobytes(), ".png"), record


def question_id(path: list[dict[str, Any]], answer_key: str, answer: str) -> str:
    key = json.dumps([[p["entity_id"], p["relation"]] for p in path] + [fold(answer_key), fold(answer)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def synthesize_shard(graph: Graph, cfg: SynthConfig, shard: int, seeds: list[int], split_of: Mapping[int, str],
                     images: ImageStore) -> tuple[list[dict[str, Any]], dict[str, Counter[str]]]:
    """All questions of one shard, and its counts by stage and reason."""
    rng = np.random.default_rng([cfg.run.seed, shard])
    counts: dict[str, Counter[str]] = {s: Counter() for s in ("walk_skips", "walk", "rewrite", "invariants",
                                                              "dedupe", "images", "rewriter", "seeds")}
    wcfg = WalkConfig(cfg.walk.hub_in_degree, cfg.walk.max_answer_words, cfg.walk.entity_answers)
    probs = np.array(cfg.walk.hop_probs) / sum(cfg.walk.hop_probs)
    kg_name = str(graph.root.name if graph.root else "memory")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for seed in seeds:
        anchors = [a for a in graph.anchors[seed] if a.score >= cfg.min_grounding_score
                   and graph.root is not None and (graph.root / "images" / a.image).is_file()]
        unlicensed = [a for a in anchors if not a.licence.strip()]
        counts["images"]["anchor_without_licence"] += len(unlicensed)  # no redistributable image, no question
        anchors = [a for a in anchors if a.licence.strip()]
        if not anchors:
            counts["images"]["seed_without_image_file"] += 1  # checked once here, not after every walk
            counts["seeds"][f"{split_of[seed]}/empty/no_image_file"] += 1
            continue
        made = misses = 0
        failed: Counter[str] = Counter()  # this seed's failures, to say why it yielded nothing
        for _ in range(cfg.attempts_per_seed):
            if made >= cfg.questions_per_seed:
                break
            if misses >= cfg.patience:
                counts["walk"]["seed_exhausted"] += 1
                break
            hops = int(cfg.walk.hops[int(rng.choice(len(probs), p=probs))])
            row = None
            for _ in range(cfg.walk.max_retries):
                skips: Counter[str] = Counter()
                walk = random_walk(graph, seed, hops, rng, split_of, wcfg, skips)
                counts["walk_skips"].update(skips)
                if walk is None:
                    counts["walk"]["dead_end"] += 1
                    failed.update(k for k in skips if k.startswith("dead_end"))
                    continue
                drops: Counter[str] = Counter()
                draft = template_rewrite(graph, walk, rng, drops, cfg.rewriter.key_case)
                if draft is None:
                    counts["rewrite"].update(drops)
                    failed.update(drops)
                    continue
                qid = question_id(draft.path, draft.answer_key, draft.answer)
                if qid in seen:
                    counts["dedupe"]["same_path_and_answer"] += 1
                    failed["same_path_and_answer"] += 1
                    continue
                row = {"id": qid, "question": draft.question, "answer": draft.answer,
                       "answer_aliases": draft.answer_aliases, "answer_key": draft.answer_key,
                       "path": draft.path, "hops": hops}
                broken = violations(graph, row)
                if broken:
                    counts["invariants"][broken[0]] += 1
                    failed[broken[0]] += 1
                    row = None
                    continue
                break
            if row is None:
                counts["walk"]["retries_exhausted"] += 1
                misses += 1
                continue
            misses = 0
            anchor = anchors[int(rng.integers(len(anchors)))]
            try:
                if rng.random() < cfg.degrade.share:
                    kind = cfg.degrade.kinds[int(rng.integers(len(cfg.degrade.kinds)))]
                    name, record = images.degraded(anchor.image, kind, rng)
                    row["degraded"], row["degradation"] = True, json.dumps(record)
                else:
                    name = images.original(anchor.image)
                    row["degraded"], row["degradation"] = False, ""
            except (OSError, ValueError):
                counts["images"]["bad_image"] += 1  # a missing or corrupt file drops the question, not the run
                failed["bad_image"] += 1
                continue
            seen.add(row["id"])
            row.update(images=[name], licence=anchor.licence, split=split_of[seed],
                       provenance={"kg": kg_name, "anchor_image": anchor.image, "anchor_source": anchor.source,
                                   "caption": anchor.caption, "grounding_score": anchor.score,
                                   "scorer": anchor.scorer, "rewriter": "template", "shard": shard})
            rows.append(row)
            made += 1
        if made:
            counts["seeds"][f"{split_of[seed]}/yielded"] += 1
        else:  # the seed's most frequent failure, e.g. dead_end_hop2 when its neighbourhood is another split's
            reason = failed.most_common(1)[0][0] if failed else "no_attempt"
            counts["seeds"][f"{split_of[seed]}/empty/{reason}"] += 1
    if cfg.rewriter.kind == "llm" and rows:
        r = cfg.rewriter
        drafts = [_draft_of(row) for row in rows]
        texts = llm_rewrite(r.endpoint, graph, drafts, counts["rewriter"], r.temperature)
        for row, text in zip(rows, texts, strict=True):
            candidate = {**row, "question": text}
            if text != row["question"] and not violations(graph, candidate):
                row["question"] = text
                row["provenance"]["rewriter"] = f"llm:{r.endpoint.model}"
    return rows, counts


def _draft_of(row: dict[str, Any]) -> Any:
    return Draft(row["question"], row["path"], row["answer_key"], row["answer"], row["answer_aliases"])


class ShardWorker:
    """Ray Data callable class: maps the compiled KG once per actor, then synthesizes and commits whole shards."""

    def __init__(self, cfg: SynthConfig, out_dir: str, job: str):
        self.cfg, self.job = cfg, job
        self.graph = Graph.load(self.cfg.kg_dir or None, max_answer_words=self.cfg.walk.max_answer_words)
        self.shards, self.split_of = plan(self.graph, self.cfg)
        self.out = storage.attach(out_dir)  # the run folder's location: this node may hold no copy yet
        self.images = ImageStore(self.graph, self.out / "images")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        done, sizes, secs = [], [], []
        for shard in batch["shard"].tolist():
            t0 = time.perf_counter()
            rows, counts = synthesize_shard(self.graph, self.cfg, shard, self.shards[shard], self.split_of,
                                            self.images)
            if shard == 0:  # the graph is the same for every shard: count its bad rows once
                counts["graph_bad_rows"] = Counter(self.graph.bad)
            commit_shard(self.out / "shards", shard, rows, counts)
            record_counts(self.job, self.out.name, {"seeds": len(self.shards[shard]), "questions": len(rows)}, counts)
            # the shard's parquet is its "done" marker: published last
            storage.publish(self.out, "images", f"shards/shard-{shard:05d}.json", f"shards/shard-{shard:05d}.parquet")
            done.append(shard)
            sizes.append(len(rows))
            secs.append(time.perf_counter() - t0)
        return {"shard": np.array(done), "questions": np.array(sizes), "seconds": np.array(secs)}


def record_counts(job: str, run: str, rows: dict[str, int], drops: dict[str, Counter[str]]) -> None:
    """Export rows out of each stage and drops by stage and reason (``osvl_synth_*``, labels osvl_job, run)."""
    rec = M.Recorder(job, run)
    for stage, n in rows.items():
        rec.inc(M.SYNTH_ROWS, n, stage=stage)
    for stage, reasons in drops.items():
        for reason, n in reasons.items():
            rec.inc(M.SYNTH_DROPPED, n, stage=stage, reason=reason)


def shard_path(shard_dir: Path, shard: int) -> Path:
    return shard_dir / f"shard-{shard:05d}.parquet"


def commit_shard(shard_dir: Path, shard: int, rows: list[dict[str, Any]], counts: dict[str, Counter[str]]) -> None:
    """Counts first, then the rows by atomic rename: a shard exists exactly when its Parquet file does."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    final = shard_path(shard_dir, shard)
    final.with_suffix(".json").write_text(json.dumps({k: dict(v) for k, v in counts.items()}, sort_keys=True))
    table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    with storage.atomic(final) as tmp:
        pq.write_table(table, tmp)


def _apply_filter_stage(cfg: SynthConfig, table: pa.Table) -> pa.Table:
    """Stage 3 slot: run ``filter.stage`` over the candidates with Ray Data; identity when unset."""
    if not cfg.filter.stage or table.num_rows == 0:
        return table
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    module, _, name = cfg.filter.stage.partition(":")
    try:
        stage_cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"filter.stage {cfg.filter.stage!r} cannot be imported: {e}") from None
    ds = ray.data.from_arrow(table).map_batches(stage_cls, batch_format="pyarrow", num_gpus=cfg.filter.num_gpus or None,
                                                fn_constructor_args=(cfg,),
                                                compute=ray.data.ActorPoolStrategy(size=cfg.filter.workers))
    parts = [pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b
             for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)]
    return pa.concat_tables(parts).cast(ROW_SCHEMA) if parts else table.slice(0, 0)


def _largest_cap(sizes: list[int], share: float) -> int | None:
    """Largest per-group cap k with k <= share * sum(min(size, k)); None when even k = 1 fails."""
    for k in range(max(sizes, default=0), 0, -1):
        if k <= share * sum(min(c, k) for c in sizes):
            return k
    return None


EVENNESS = 0.9  # an infeasible answer cap keeps answers at least this even (normalised entropy; 1: one per answer)


def _even_cap(sizes: list[int]) -> int:
    """The largest per-group cap k whose capped sizes min(size, k) stay ``EVENNESS`` as even as one per group
    (normalised entropy), the relaxed cap of an answer share no cap can meet: as many questions as the answers
    there are allow without one answer taking over (a KG whose item-valued facts point to a few countries)."""
    if len(sizes) < 2:
        return max(sizes, default=1)
    for k in range(max(sizes), 0, -1):
        p = np.array([min(c, k) for c in sizes], dtype=float)
        p /= p.sum()
        if -(p * np.log(p)).sum() / np.log(len(sizes)) >= EVENNESS:
            return k
    return 1


def cap_shares(table: pa.Table, max_answer_share: float, max_seed_share: float, drops: Counter[str]) -> pa.Table:
    """Drop the surplus of over-represented seeds, then answers (deterministic).

    The cap is the largest one that still holds *after* the drop. Within a group the questions kept are
    spread over the other label first (an answer keeps one question of each seed before a second of any,
    a seed one of each answer), lowest ids next, so a cap keeps the most varied set. When a cap cannot
    hold at all (fewer groups than 1 / share), ``<reason>_infeasible`` in the data card says so; then seeds
    keep their questions (few seeds is what a small KG has), and the answer cap is relaxed to the largest
    one that keeps the answers ``EVENNESS`` as even as one question per answer (``_even_cap``;
    ``answer_share_cap_relaxed_to`` in the card): a tree-shaped KG's walks converge on a few final entities,
    and one question per answer left 14 of a 40-seed Wikidata KG's questions (docs/measurements.md).
    """
    table = table.sort_by("id")
    groups = {"seed_share_cap": [p[0]["entity_id"] for p in table.column("path").to_pylist()],
              "answer_share_cap": [fold(a) for a in table.column("answer").to_pylist()]}
    keep = list(range(table.num_rows))
    for _ in range(3):  # the answer cap lowers the total a little; a second pass settles the seed cap
        changed = False
        for reason, share in (("seed_share_cap", max_seed_share), ("answer_share_cap", max_answer_share)):
            labels = groups[reason]
            other = groups["answer_share_cap" if reason == "seed_share_cap" else "seed_share_cap"]
            sizes = list(Counter(labels[i] for i in keep).values())
            cap = _largest_cap(sizes, share)
            if cap is None:
                drops[f"{reason}_infeasible"] = 1
                if reason == "seed_share_cap":
                    continue  # few seeds is what a small KG has: keep their questions
                cap = drops["answer_share_cap_relaxed_to"] = _even_cap(sizes)
            nth: Counter[Any] = Counter()
            ranked = []
            for i in keep:
                nth[(labels[i], other[i])] += 1
                ranked.append((nth[(labels[i], other[i])], i))
            seen: Counter[Any] = Counter()
            kept = []
            for _, i in sorted(ranked):
                seen[labels[i]] += 1
                if seen[labels[i]] <= cap:
                    kept.append(i)
            drops[reason] += len(keep) - len(kept)
            changed |= len(kept) != len(keep)
            keep = sorted(kept)
        if not changed:
            break
    return table.take(pa.array(keep, type=pa.int64()))


def _histogram(values: list[Any]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items(), key=lambda kv: (-kv[1], str(kv[0])))}


def data_card(cfg: SynthConfig, table: pa.Table, counts: dict[str, Counter[str]], seconds: float,
              seeds_planned: int) -> dict[str, Any]:
    n = max(1, table.num_rows)
    paths = table.column("path").to_pylist()
    answers = [fold(a) for a in table.column("answer").to_pylist()]
    seeds = [p[0]["entity_id"] for p in paths]
    hops = table.column("hops").to_pylist()
    degraded = table.column("degraded").to_pylist()
    kinds = [json.loads(d)["kind"] for d in table.column("degradation").to_pylist() if d]
    scores = sorted({(p[0]["entity_id"], prov["anchor_image"], prov["grounding_score"])
                     for p, prov in zip(paths, table.column("provenance").to_pylist(), strict=True)})
    score_values = np.array([s for _, _, s in scores], dtype=float) if scores else np.zeros(1)
    top_answer = Counter(answers).most_common(1)
    top_seed = Counter(seeds).most_common(1)
    hop_hist = Counter(hops)
    return {
        "questions": table.num_rows,
        "splits": _histogram(table.column("split").to_pylist()),
        "seconds": round(seconds, 1),
        "config_hash": config_hash(cfg),
        "seed_entities": len(set(seeds)),
        "seeds_planned": seeds_planned,  # grounded entities; the rest had no walkable neighbourhood
        "final_entities": len({p[-1]["entity_id"] for p in paths}),
        "path_entities": len({e["entity_id"] for p in paths for e in p}),
        "max_seed_share": round(top_seed[0][1] / n, 4) if top_seed else 0.0,
        "max_answer_share": round(top_answer[0][1] / n, 4) if top_answer else 0.0,
        "max_answer_share_configured": cfg.max_answer_share,
        "top_answers": dict(Counter(answers).most_common(10)),
        "hops": {str(h): {"count": hop_hist[h], "share": round(hop_hist[h] / n, 4), "configured": p}
                 for h, p in zip(cfg.walk.hops, cfg.walk.hop_probs, strict=True)},
        "answer_keys": _histogram([fold(k) for k in table.column("answer_key").to_pylist()]),
        "degraded": {"share": round(sum(degraded) / n, 4), "configured": cfg.degrade.share,
                     "kinds": _histogram(kinds)},
        "descriptor_kinds": _histogram([e["descriptor_kind"] for p in paths for e in p[1:]]),
        "rewriter": _histogram([p["rewriter"] for p in table.column("provenance").to_pylist()]),
        "drops": {stage: dict(sorted(c.items())) for stage, c in sorted(counts.items()) if c and stage != "seeds"},
        "grounding_scores": {"anchors_used": len(scores), "min": round(float(score_values.min()), 4),
                             "median": round(float(np.median(score_values)), 4),
                             "max": round(float(score_values.max()), 4),
                             "histogram": {f"{k / 10:.1f}-{(k + 1) / 10:.1f}": int(n) for k, n in
                                           enumerate(np.histogram(score_values, bins=10, range=(0.0, 1.0))[0])}},
        "seeds_by_split": {split: {"yielded": counts.get("seeds", Counter())[f"{split}/yielded"],
                                   "empty": {k.split("/", 2)[2]: v for k, v in sorted(counts.get("seeds", {}).items())
                                             if k.startswith(f"{split}/empty/")}}
                           for split in SPLITS[:len(cfg.split_fractions)]},
    }


def card_markdown(card: dict[str, Any]) -> str:
    lines = [f"# Data card: synthesized questions ({card['questions']} questions, config {card['config_hash']})", "",
             f"Splits: {card['splits']}. Seeds: {card['seed_entities']} of {card['seeds_planned']} grounded, "
             f"final entities: {card['final_entities']}, "
             f"path entities: {card['path_entities']}. Largest seed share {card['max_seed_share']:.1%}, "
             f"largest answer share {card['max_answer_share']:.1%}. Built in {card['seconds']} s.", "",
             "## Hops", "", "| hops | questions | share | configured |", "|---|---|---|---|"]
    lines += [f"| {h} | {v['count']} | {v['share']:.1%} | {v['configured']:.0%} |" for h, v in card["hops"].items()]
    lines += ["", "## Seeds by split", "", "| split | yielded | empty (why) |", "|---|---|---|"]
    lines += [f"| {s} | {v['yielded']} | {sum(v['empty'].values())} {v['empty'] or ''} |"
              for s, v in card["seeds_by_split"].items()]
    caps = card["drops"].get("caps", {})
    if caps.get("answer_share_cap_infeasible"):
        lines += ["", "Answer-share cap relaxed: fewer distinct answers than 1 / "
                  f"{card['max_answer_share_configured']}, so no cap meets that share; each answer kept at most "
                  f"{caps.get('answer_share_cap_relaxed_to')} questions (the largest cap keeping the answers "
                  f"{EVENNESS:.0%} as even as one question per answer, by normalised entropy), "
                  f"{caps.get('answer_share_cap', 0)} dropped; largest answer share {card['max_answer_share']:.1%}."]
    lines += ["", "## Answer keys (top 25)", "", "| key | questions |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in list(card["answer_keys"].items())[:25]]
    d = card["degraded"]
    lines += ["", f"## Degradation\n\nshare {d['share']:.1%} (configured {d['configured']:.0%}); kinds {d['kinds']}",
              "", "## Drops by stage and reason", "", "| stage | reason | count |", "|---|---|---|"]
    lines += [f"| {s} | {r} | {c} |" for s, reasons in card["drops"].items() for r, c in reasons.items()]
    g = card["grounding_scores"]
    lines += ["", f"## Grounding scores\n\n{g['anchors_used']} anchors used; min {g['min']}, median {g['median']}, "
              f"max {g['max']}; histogram {g['histogram']}", ""]
    return "\n".join(lines)


def finalize(cfg: SynthConfig, out: Path, num_shards: int, seconds: float, seeds_planned: int, job: str
             ) -> dict[str, Any]:
    """Read every committed shard, run the filter slot and the caps, write the splits and the data card."""
    shard_dir = out / "shards"
    tables, counts = [], {}
    for k in range(num_shards):
        tables.append(pq.read_table(shard_path(shard_dir, k)).cast(ROW_SCHEMA))
        for stage, c in json.loads(shard_path(shard_dir, k).with_suffix(".json").read_text()).items():
            counts.setdefault(stage, Counter()).update(c)
    table = pa.concat_tables(tables) if tables else ROW_SCHEMA.empty_table()
    before = table.num_rows
    table = _apply_filter_stage(cfg, table)
    if table.num_rows != before:
        counts.setdefault("difficulty_filter", Counter())["rejected"] += before - table.num_rows
    counts["caps"] = Counter()
    table = cap_shares(table, cfg.max_answer_share, cfg.max_seed_share, counts["caps"])
    for split in SPLITS[:len(cfg.split_fractions)]:  # dev.parquet only when the config makes a dev split
        part = table.filter(pc.equal(table.column("split"), split))
        with storage.atomic(out / f"{split}.parquet") as tmp:
            pq.write_table(part, tmp)
    record_counts(job, out.name, {"kept": table.num_rows},
                  {k: counts[k] for k in ("difficulty_filter", "caps") if k in counts})
    card = data_card(cfg, table, counts, seconds, seeds_planned)
    (out / "data_card.json").write_text(json.dumps(card, indent=1, sort_keys=False))
    (out / "data_card.md").write_text(card_markdown(card))
    return card


def check_same_kg(graph: Graph, shard_dir: Path) -> None:
    """Resume only over the KG the committed shards came from (the config hash cannot see a rebuilt KG)."""
    digest = hashlib.sha256()
    for name in ("entities.parquet", "links.parquet", "anchors.parquet"):
        path = graph.root / name if graph.root else None
        if path and path.is_file():
            with open(path, "rb") as f:  # in chunks: a large KG's tables need not fit the driver
                for chunk in iter(lambda f=f: f.read(1 << 24), b""):
                    digest.update(chunk)
    stamp, fingerprint = shard_dir / "kg.sha256", digest.hexdigest()
    shard_dir.mkdir(parents=True, exist_ok=True)
    if stamp.is_file() and stamp.read_text().strip() != fingerprint:
        raise ConfigError(f"{shard_dir.parent} holds shards made from another KG; pick a new --run.name "
                          "or delete that folder to start over")
    stamp.write_text(fingerprint + "\n")


def run_shards(worker: type, kwargs: dict[str, Any], todo: list[int], total: int, *, workers: int,
               role_units: float, desc: str, line: Callable[[dict[str, Any]], str],
               log: Callable[[str], None]) -> None:
    """Run the shards ``todo`` (of ``total``) on a Ray Data pool of ``worker`` actors, one CPU each on the nodes
    of the data role; log each finished shard with ``line(row)`` of the row its worker returns.

    The synthesize and trajectories jobs both shard this way: a worker writes and publishes its shard and
    its "done" marker itself, so a killed job resumes at the first shard without a marker.
    """
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    ds = ray.data.from_items([{"shard": k} for k in todo], override_num_blocks=len(todo))
    ds = ds.map_batches(worker, fn_constructor_kwargs=kwargs, batch_size=1, num_cpus=1,
                        resources=role_resources("data", role_units),
                        compute=ray.data.ActorPoolStrategy(size=min(workers, len(todo))))
    finished = total - len(todo)
    with Progress(total, desc, "shards", initial=finished) as bar:
        for row in ds.iter_rows():
            finished += 1
            log(f"  shard {int(row['shard']):5d} done: {line(row)} ({finished}/{total})")
            bar.update(1)
