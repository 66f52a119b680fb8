"""Ask the agent one question about one image and print the whole trajectory.

    python jobs/ask.py --image FILE --question TEXT [--model DIR] [--engine hf|vllm]
                       [--tools inprocess|http --url URL] [--agent.max_turns=8 ...]

``--key value`` and ``--key=value`` both work; what it prints: osvl/agent/job.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.agent.job import JOB, AskConfig, run  # noqa: E402
from osvl.config import cli  # noqa: E402
from osvl.logs import start_job  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    print(run(start_job(AskConfig, JOB, argv)), flush=True)


if __name__ == "__main__":
    cli(main)
