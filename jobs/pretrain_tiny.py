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

Deterministic from ``run.seed`` on one machine type; nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.logs import start_job  # noqa: E402
from osvl.models.pretrain import JOB, PretrainConfig, corpus_rows, train, turns_text  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    from osvl.agent.trajectory import read_trajectories
    from osvl.config import parse_args, run_dir, upstream_config
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint
    from osvl.rl.job import GRPOConfig
    from osvl.rl.trainer import JOB as GRPO_JOB
    from osvl.synth import expert, pipeline

    cfg = start_job(PretrainConfig, JOB, argv)
    cfg.check()
    grpo = parse_args(GRPOConfig, GRPO_JOB, [f"--profile={cfg.grpo_profile}"])
    scfg = upstream_config(pipeline.SynthConfig, pipeline.JOB, cfg.run, grpo.synth)
    qdir, _ = pipeline.run(scfg)
    base_kind = "qwen3_vl"  # its tokenizer renders the records, and the pretrained model keeps it

    def trajectories(split: str, n: int) -> Path:
        tcfg = upstream_config(expert.TrajConfig, expert.JOB, cfg.run, {
            "questions": str(qdir), "offer": list(grpo.rollout.offer), **grpo.trajectories,
            "split": split, "max_questions": n, "n_teacher_rollouts": 1, "tiny_kind": base_kind})
        return expert.run(tcfg)[0] / "trajectories.parquet"

    base = Path(cfg.init) if cfg.init else tiny_checkpoint(base_kind)
    tok = load_processor(base).tokenizer
    held = pipeline.split_titles(scfg, "heldout")
    tpath = trajectories("sft", 0)
    trajs = list(read_trajectories(tpath))
    rows = corpus_rows(trajs, tok, held, cfg.max_len)
    # a row's answer is its last turn: a row cut at max_len never shows one (answers 0/96 at max_len 1024)
    n_cut = sum(len(r) > cfg.max_len for r in corpus_rows(trajs, tok, held, 1 << 16))
    probe = []
    if cfg.probe_questions:  # whole held-out trajectories, to read, never to train on
        probe = corpus_rows(read_trajectories(trajectories("heldout", cfg.probe_questions)), tok, set(), 1 << 16)
    out = run_dir(cfg, JOB)
    report = train(cfg, rows, base, out, extra={"trajectories": str(tpath.parent), "heldout_entities": len(held),
                                             "rows_over_max_len": n_cut},
                   probe=probe)
    print(f"pretrain_tiny: {report['rows']} rows ({report['tokens']:,} tokens; {len(held)} held-out entities cut "
          f"out; {n_cut} rows cut at max_len={cfg.max_len}), {cfg.steps} steps in {report['seconds'] / 60:.1f} min, "
          f"validation loss {report['val_loss']:.4f} -> {report['model']}", flush=True)
    if report["heldout_turns"]:
        print(f"pretrain_tiny: held-out turns greedy decoding reproduces whole: {turns_text(report['heldout_turns'])}",
              flush=True)
    return report


if __name__ == "__main__":
    main()
