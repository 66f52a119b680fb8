"""The synthesized dataset, checked from the outside.

This module does not import ``osvl.synth``: it runs ``jobs/synthesize.py`` as a
process, then reads the output splits and the KG tables with pyarrow alone and
re-implements the three invariants from their definitions:

- answer invariance: resolving each question's structured form (``path``) from its
  start entity over the KG links reaches the recorded final entity, whose attribute
  ``answer_key`` has exactly the answer as its value, or, when the last step is the
  asked entity (kind ``answer``), whose title is the answer, over the relation ``answer_key``;
- unique referent: at each hop exactly one entity linked from the previous one
  (through the hop's relation; any link for ``linked_to``) satisfies the descriptor;
- zero leakage: no title or alias of a path entity (also without its parenthetical),
  nor the answer or its aliases, occurs as whole words in the folded question.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "osvl" / "kg" / "sample"


def fold(text: str) -> str:
    s = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).casefold()
    return re.sub(r"[\W_]+", " ", s).strip()


class KGTables:
    def __init__(self, kg: Path):
        self.ents = {r["id"]: r for r in pq.read_table(kg / "entities.parquet").to_pylist()}
        self.any_out: dict[int, set[int]] = defaultdict(set)
        self.rel_out: dict[tuple[int, str], set[int]] = defaultdict(set)
        for r in pq.read_table(kg / "links.parquet").to_pylist():
            if r["src"] != r["dst"]:
                self.any_out[r["src"]].add(r["dst"])
                self.rel_out[(r["src"], r["relation"])].add(r["dst"])

    def holds(self, eid: int, step: dict) -> bool:
        e, kind, key, value = self.ents[eid], step["descriptor_kind"], step["descriptor_key"], step["descriptor_value"]
        if kind in ("relation", "answer"):
            return True
        if kind == "description":
            return bool(fold(value)) and fold(e["description"]) == fold(value)
        if kind == "category":
            return value in e["categories"]
        if kind == "attribute":
            return any(fold(a["key"]) == fold(key) and fold(a["value"]) == fold(value) for a in e["attributes"])
        raise AssertionError(f"unknown descriptor kind {kind}")

    def problems(self, row: dict) -> list[str]:
        out = []
        path = row["path"]
        cur = path[0]["entity_id"]
        for hop, step in enumerate(path[1:], start=1):
            pool = self.any_out[cur] if step["relation"] == "linked_to" else self.rel_out[(cur, step["relation"])]
            matches = [x for x in pool if self.holds(x, step)]
            if len(matches) != 1:
                out.append(f"hop {hop}: {len(matches)} referents")
                break
            cur = matches[0]
        else:
            if cur != path[-1]["entity_id"]:
                out.append("reaches another entity")
            key = fold(row["answer_key"])
            if path[-1]["descriptor_kind"] == "answer":
                if fold(self.ents[cur]["title"]) != fold(row["answer"]) or fold(path[-1]["relation"]) != key:
                    out.append(f"answer {row['answer']!r} is not the {key} {self.ents[cur]['title']!r}")
            else:
                values = [fold(a["value"]) for a in self.ents[cur]["attributes"] if fold(a["key"]) == key]
                if values != [fold(row["answer"])]:
                    out.append(f"answer {row['answer']!r} is not the value {values}")
        names = [row["answer"], *row["answer_aliases"]]
        for step in path:
            e = self.ents[step["entity_id"]]
            names += [e["title"], *e["aliases"]]
        q = f" {fold(row['question'])} "
        for name in names:
            for form in {fold(name), fold(re.sub(r"\s*\([^)]*\)\s*", " ", name))}:
                if form and f" {form} " in q:
                    out.append(f"leaks {form!r}")
        return out


def run_job(tmp: Path, *args: str) -> Path:
    env = {**os.environ, "OSVL_RUN_ROOT": str(tmp / "runs")}
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "synthesize.py"), "--run.name=t", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "runs" / "synthesize" / "t"


def check_output(out: Path, kg: Path) -> list[dict]:
    tables = KGTables(kg)
    rows, split_entities = [], {}
    for split in ("sft", "rl", "heldout"):
        part = pq.read_table(out / f"{split}.parquet").to_pylist()
        # an asked entity (a country, an occupation) is an answer, as an attribute's value is: splits may share it
        split_entities[split] = {s["entity_id"] for r in part for s in r["path"] if s["descriptor_kind"] != "answer"}
        rows += part
    assert rows
    bad = {r["id"]: p for r in rows if (p := tables.problems(r))}
    assert not bad, f"{len(bad)} of {len(rows)} questions break an invariant, e.g. {list(bad.items())[:3]}"
    assert len({r["id"] for r in rows}) == len(rows)
    keys = {(tuple((s["entity_id"], s["relation"]) for s in r["path"]), fold(r["answer_key"]), fold(r["answer"]))
            for r in rows}
    assert len(keys) == len(rows)  # identical path-and-answer questions emitted once
    s = split_entities
    assert not (s["sft"] & s["rl"]) and not (s["sft"] & s["heldout"]) and not (s["rl"] & s["heldout"])
    for r in rows:
        assert r["hops"] == len(r["path"]) - 1 and 1 <= len(r["answer"].split()) <= 6
        if r["path"][-1]["descriptor_kind"] == "answer":  # an asked entity: over a relation that is a fact, not a type
            assert fold(r["answer_key"]) not in ("linked to", "instance of", "subclass of"), r["question"]
        assert all((out / "images" / name).is_file() for name in r["images"])
        if r["degraded"]:
            rec = json.loads(r["degradation"])
            assert rec["undo_tool"] in ("sharpen", "super_resolution", "perspective_correct")
        assert r["licence"] and r["provenance"]["anchor_image"]
    card = json.loads((out / "data_card.json").read_text())
    assert card["questions"] == len(rows) and (out / "data_card.md").is_file()
    return rows


@pytest.mark.slow
def test_output_of_a_small_kg_keeps_every_invariant(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_synth import make_kg

    kg = make_kg(tmp_path / "kg")
    out = run_job(tmp_path, f"--kg_dir={kg}", "--num_shards=3", "--questions_per_seed=25", "--degrade.share=0.3")
    rows = check_output(out, kg)
    assert len(rows) >= 200
    assert 0.15 < sum(r["degraded"] for r in rows) / len(rows) < 0.45


@pytest.mark.slow
def test_output_on_the_sample_keeps_every_invariant(tmp_path):
    out = run_job(tmp_path, "--questions_per_seed=12", "--num_shards=4")
    rows = check_output(out, SAMPLE)
    assert len({r["path"][0]["entity_id"] for r in rows}) >= 20
