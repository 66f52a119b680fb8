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
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osvl.config import cli  # noqa: E402
from osvl.errors import ConfigError  # noqa: E402
from osvl.logs import start_job  # noqa: E402
from osvl.models.pretrain import BASE_KIND, JOB, PretrainConfig, corpus_rows, export, train, turns_text  # noqa: E402

if TYPE_CHECKING:
    from osvl.config import RunConfig
    from osvl.recipe import GRPOJobConfig


def demo_trajectories(run: RunConfig, grpo: GRPOJobConfig, split: str, n: int,
                      synth: dict[str, Any] | None = None) -> tuple[Path, set[str]]:
    """The oracle's trajectories (one rollout each) of the first ``n`` (0: every) questions of ``split`` under the
    data recipe of ``grpo`` (a GRPO profile's config, ``grpo_recipe``: its ``synth`` and ``trajectories``
    sections; ``synth``, when given, is applied to the synthesize job's demo profile instead: a card's record
    of the recipe its policy was made with), built or reused under ``run.root``, and the titles of the held-out
    and dev splits' entities. The committed policy's test rebuilds its probe with it."""
    import dataclasses

    from osvl import recipe
    from osvl.config import upstream_config
    from osvl.synth import expert, pipeline

    scfg = grpo.synth if synth is None else upstream_config(pipeline.SynthConfig, pipeline.JOB, run, synth)
    qdir = recipe.questions(run, scfg)
    tcfg = dataclasses.replace(grpo.trajectories, run=recipe.stage_run(run), questions=str(qdir),
                               offer=list(grpo.rollout.offer), split=split, max_questions=n, n_teacher_rollouts=1,
                               tiny_kind=BASE_KIND)
    # the corpus shows nothing of the entities questions are scored on: held-out, nor dev where settings are tuned
    return expert.run(tcfg)[0] / "trajectories.parquet", pipeline.split_titles(scfg, "heldout", "dev")


def grpo_recipe(grpo_profile: str) -> GRPOJobConfig:
    """The GRPO profile's config: its ``synth`` and ``trajectories`` sections are the demo's data recipe."""
    from osvl.config import parse_args
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB as GRPO_JOB

    return parse_args(GRPOJobConfig, GRPO_JOB, [f"--profile={grpo_profile}"])


def recipe_entries(synth: Any) -> dict[str, Any]:
    """The entries of a GRPO profile's synth section that differ from the synthesize job's demo profile (its run
    aside): the data recipe as a card records it, small and free of this machine's paths."""
    from osvl.config import parse_args, to_dict
    from osvl.synth.pipeline import JOB as SYNTH_JOB
    from osvl.synth.pipeline import SynthConfig

    def diff(got: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        return {k: (diff(v, base[k]) if isinstance(v, dict) else v) for k, v in got.items()
                if k != "run" and v != base[k]}

    return diff(to_dict(synth), to_dict(parse_args(SynthConfig, SYNTH_JOB, [])))


def main(argv: list[str] | None = None) -> dict:
    import json

    from osvl.agent.trajectory import read_trajectories
    from osvl.config import input_path, run_dir
    from osvl.models.load import load_processor
    from osvl.models.tiny import tiny_checkpoint

    cfg = start_job(PretrainConfig, JOB, argv)
    cfg.check()
    base = Path(cfg.init) if cfg.init else tiny_checkpoint(BASE_KIND)
    tok = load_processor(base).tokenizer
    grpo = grpo_recipe(cfg.grpo_profile)
    tpath, held = demo_trajectories(cfg.run, grpo, "sft", 0)
    probe = []
    if cfg.probe_questions:  # whole held-out trajectories, to read, never to train on
        ppath, _ = demo_trajectories(cfg.run, grpo, "heldout", cfg.probe_questions)
        probe = corpus_rows(read_trajectories(ppath), tok, set(), 1 << 16)
    out = run_dir(cfg, JOB)
    if (out / "report.json").is_file() and (out / "model").is_dir():  # finished: rerun to export, not to train
        report = json.loads((out / "report.json").read_text())
        n_cut = report["rows_over_max_len"]
        print(f"pretrain_tiny: reusing the finished run {out}", flush=True)
    else:
        trajs = list(read_trajectories(tpath))
        rows = corpus_rows(trajs, tok, held, cfg.max_len)
        # a row's answer is its last turn: a row cut at max_len never shows one (answers 0/96 at max_len 1024)
        n_cut = sum(len(r) > cfg.max_len for r in corpus_rows(trajs, tok, held, 1 << 16))
        # the recipe as trained on: the profile may change before a later rerun exports this run
        report = train(cfg, rows, base, out, extra={"trajectories": str(tpath.parent), "heldout_entities": len(held),
                                                 "rows_over_max_len": n_cut,
                                                 "synth": recipe_entries(grpo.synth)},
                       probe=probe)
    print(f"pretrain_tiny: {report['rows']} rows ({report['tokens']:,} tokens; {len(held)} held-out entities cut "
          f"out; {n_cut} rows cut at max_len={cfg.max_len}), {cfg.steps} steps in {report['seconds'] / 60:.1f} min, "
          f"validation loss {report['val_loss']:.4f} -> {report['model']}", flush=True)
    if report["heldout_turns"]:
        print(f"pretrain_tiny: held-out turns greedy decoding reproduces whole: {turns_text(report['heldout_turns'])}",
              flush=True)
    if cfg.export_to:
        if "synth" not in report:
            raise ConfigError(f"{out} was trained before its report recorded the data recipe; train it again "
                              "(another --run.name) to export it")
        card = export(out / "model", input_path(cfg.export_to), probe, {
            "grpo_profile": cfg.grpo_profile, "synth": report["synth"],
            "heldout_questions": cfg.probe_questions, "run": out.name,
            **{k: report[k] for k in ("rows", "tokens", "steps", "seconds", "val_loss", "heldout_turns")}})
        print(f"pretrain_tiny: exported float16 weights to {cfg.export_to} (held-out loss {card['heldout_loss']:.4f} "
              f"on the oracle's trajectories of {cfg.probe_questions} held-out questions)", flush=True)
    return report


if __name__ == "__main__":
    cli(main)
