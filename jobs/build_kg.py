"""MediaWiki ``pages-articles`` dump -> KG Parquet tables: ``python jobs/build_kg.py [--profile=NAME] [--key=value]``.

    python jobs/build_kg.py                          # demo: the shared 2016 sample, 2 workers
    ray job submit --working-dir . -- python jobs/build_kg.py --profile=production \\
        --input=/shared/enwiki-latest-pages-articles.xml.bz2 --run.root=/shared/runs

Ray Data parses shards of the dump in parallel; a second pass resolves links through the
redirect table and writes ``<run_dir>/kg/{entities,links,anchors}.parquet`` (see
``osvl.kg.dump`` for the design). A rerun with the same config resumes: shards already
written are skipped, only the missing ones are parsed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import dump, parse_args  # noqa: E402
from osvl.kg.dump import JOB, BuildKGConfig, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(BuildKGConfig, JOB, argv)
    print(dump(cfg), flush=True)
    run(cfg, log=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
