"""Pretrain the tiny demo policy to copy: ``python jobs/pretrain_tiny.py [--key=value]``.

Builds or reuses the demo's questions (the GRPO profile's ``synth`` section) and the oracle's
trajectories of every ``sft``-split question (its ``trajectories`` section, one rollout each),
reads them as a text corpus with everything about held-out entities cut out (the oracle's
trajectories of held-out questions are read only by the progress lines' turn probe), and LM-trains the
random-init tiny Qwen3-VL on it, after tying and scaling its embeddings and two synthetic copy phases
(``osvl.models.pretrain``: why, what, how), ~100 minutes on 2 CPU cores at the demo profile. The
checkpoint it prints is an ordinary model directory to fine-tune:

    python jobs/pretrain_tiny.py
    make demo DEMO_ARGS="--sft.model=<the printed model folder>"

``--export_to=osvl/models/weights/tiny_policy`` writes it as the committed float16 base the demo profile
fine-tunes, with ``card.json`` (its held-out loss, which a test reproduces); rerun on a finished run, the
job only exports.

Deterministic from ``run.seed`` on one machine type; nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.recipe import pretrain_main as main  # noqa: E402

if __name__ == "__main__":
    cli(main)
