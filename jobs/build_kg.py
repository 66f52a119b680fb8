"""MediaWiki dump or Wikidata -> KG Parquet tables: ``python jobs/build_kg.py [--profile=NAME] [--key=value]``.

    python jobs/build_kg.py                          # demo: the shared 2016 sample, 2 workers
    ray job submit --working-dir . -- python jobs/build_kg.py --profile=production \\
        --input=/shared/enwiki-latest-pages-articles.xml.bz2 --run.root=/shared/runs
    python jobs/build_kg.py --input=extract.json --images_dir=photos/       # Wikidata JSON dump format
    python jobs/build_kg.py --input=triples.tsv --labels=labels.tsv         # Wikidata-style triples

MediaWiki (``.xml[.bz2]``): Ray Data parses shards of the dump in parallel; a second pass
resolves links through the redirect table and writes ``<run_dir>/kg/{entities,links,anchors}.parquet``
(see ``osvl.kg.dump``). A rerun with the same config resumes: shards already written are
skipped, only the missing ones are parsed.

Wikidata (``osvl.kg.wikidata``), two formats, picked by ``--format`` or the file name:
- ``wikidata_json`` (``.json``, ``.jsonl``, optionally ``.bz2``/``.gz``): the Wikidata JSON dump
  (``latest-all.json.bz2``, or an extract of it): a JSON array with one entity per line, or JSON
  Lines; each entity ``{"id": "Q90", "type": "item", "labels": {"en": {"value": ...}},
  "descriptions": ..., "aliases": ..., "claims": {"P17": [{"mainsnak": {"datavalue": ...}}]}}``.
  Property entities in the file name the relations (common ones are built in).
- ``wikidata_triples`` (``.tsv`` tab-separated, ``.csv`` comma-separated): rows
  ``subject, property, object`` (e.g. ``Q90, P17, Q142`` or ``Q90, population, 2148000``) and a
  label table ``--labels`` with rows ``id, label[, description[, aliases separated by |]]``.
Claims whose object is an entity become links (relation = the property label), literal claims
(dates, quantities, strings) attributes, ``P31`` targets categories, ``P18`` image names; with
``--images_dir`` those photos become anchors.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.kg.job import JOB, BuildKGConfig, run  # noqa: E402
from osvl.logs import start_job  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = start_job(BuildKGConfig, JOB, argv)
    run(cfg)


if __name__ == "__main__":
    cli(main)
