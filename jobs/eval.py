"""Pass@1 of a model on benchmark files in the direct, RAG and agentic modes (see osvl/eval/job.py).

    python jobs/eval.py --benchmarks=FILE[,FILE] --modes=direct,rag,agentic --model=DIR
    python jobs/eval.py --benchmarks=FILE --model=openai:NAME --endpoint.base_url=http://127.0.0.1:8000/v1
    python jobs/eval.py --benchmarks=runs/synthesize/HASH/heldout.parquet --model=oracle --modes=agentic

Rerunning the same command resumes: items already in <run_dir>/items.jsonl are not redone.
Output in <run.root>/eval/<config hash>/ (a local folder, or a URI such as s3://BUCKET/runs: see
osvl/storage.py): items.jsonl (one record per item and mode, with the trajectory),
tables/<benchmark>__<mode>.md|json, summary.md|json, pass_at_1.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osvl.config import cli  # noqa: E402
from osvl.eval.job import JOB, EvalConfig, run  # noqa: E402
from osvl.logs import start_job  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    cfg = start_job(EvalConfig, JOB, argv)
    summary = run(cfg)
    print(json.dumps({b: {m: round(t["pass_at_1"], 4) for m, t in e["modes"].items()}
                      for b, e in summary["benchmarks"].items()}), flush=True)
    return summary


if __name__ == "__main__":
    cli(main)
