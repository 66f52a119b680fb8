"""The pretrain_tiny job (``jobs/pretrain_tiny.py``): its config and ``run``, which pretrains the tiny policy on the
corpus of given oracle trajectories (``osvl.models.pretrain``: why, what, how), or reuses a finished run, and exports
it when asked. Where the trajectories come from (the demo's data recipe, built or reused) is the recipe's business
(``osvl.recipe.pretrain_main``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from osvl.config import RunConfig, input_path, opt, profile_path, run_dir
from osvl.errors import ConfigError
from osvl.models.pretrain import BASE_KIND, corpus_rows, export, train, turns_text
from osvl.models.tiny import tiny_checkpoint

JOB = "pretrain_tiny"


def profile_recipe(grpo_profile: str) -> dict[str, Any]:
    """What the run hash sees of ``grpo_profile``: its ``synth`` and ``trajectories`` sections as written.

    The corpus is built from them, so a profile whose recipe changed must train a new run, not reuse
    the one pretrained on the old recipe under the same name (and a renamed profile with the same
    recipe reuses it).
    """
    doc = yaml.safe_load(profile_path("grpo", grpo_profile).read_text()) or {}  # the GRPO job's profiles
    return {"synth": doc.get("synth") or {}, "trajectories": doc.get("trajectories") or {}}


@dataclass
class PretrainConfig:
    """jobs/pretrain_tiny.py: LM-pretrain the tiny Qwen3-VL on oracle trajectories of the sft split."""
    RENAMED: ClassVar[dict[str, str]] = {"warmup": "warmup_share"}


    run: RunConfig = opt(RunConfig, "Run root and seed (the seed also draws batches and the validation rows).")
    grpo_profile: str = opt("demo", "GRPO profile whose synth and trajectories sections give the data recipe "
                                    "(the policy is pretrained on the same kind of questions and turns it is "
                                    "fine-tuned and trained on). The run hash covers those two sections, not "
                                    "the name.", hash_as=profile_recipe)
    init: str = opt("", "Checkpoint to start from (an earlier run's model/, to continue on a changed corpus or "
                        "at another max_len); empty: the tiny model as built. Set embed_scale (refused on tied "
                        "embeddings), copy_steps and keyed_steps to 0 when the checkpoint has been through them.")
    steps: int = opt(600, "Optimizer steps.")
    batch: int = opt(8, "Rows per step.")
    max_len: int = opt(1024, "Tokens per row (a row is cut after this).")
    lr: float = opt(2e-3, "Peak learning rate (AdamW, betas 0.9/0.95, no weight decay).")
    warmup_share: float = opt(0.05, "Linear warm-up, as a share of the steps.")
    min_lr_ratio: float = opt(0.1, "Cosine floor, as a share of lr.")
    val_rows: int = opt(64, "Rows held out for the validation loss.")
    embed_scale: float = opt(0.0, "If > 0: before training, tie the output embeddings to the input ones and scale "
                                  "them by this (5: std 0.1; ``tie_and_scale``). 0 keeps the model as built "
                                  "(untied, std 0.02), which forms no induction head within a CPU's steps.")
    copy_steps: int = opt(0, "Steps of synthetic span copies (``copy_row``, batch 32, loss on the copy only) before "
                             "the corpus: they form the induction head the corpus is too small to form.")
    keyed_steps: int = opt(0, "Steps of synthetic keyed copies after those (``keyed_row``: 7 rows in 10, the rest "
                              "``copy_row``): copying the value after \"key is\" where \" is\" follows every key, "
                              "which the plain copy head cannot place.")
    keyed_links: list[str] = opt([" is"], "Link strings a keyed row puts between key and value, one drawn per row: "
                                          "\" is\" as in the question's clauses, \":\" as in a passage's "
                                          "\"Key: value.\" lines, where an answer is read.")
    keyed_mix: int = opt(0, "Synthetic rows (keyed and copy, as in the keyed phase) added to every corpus batch, "
                            "their copy loss added to the corpus loss: without them the corpus erases the keyed "
                            "skill (90/100 fresh values whole before it, 6/100 after; with 8 rows: 93 and 98/100).")
    swap_share: float = opt(0.0, "Share of training rows whose copied spans (clause values, descriptions, hit "
                                 "titles, the answer) are swapped for other rows' spans of the same kind, "
                                 "consistently within the row (``swap_spans``): a copied span can then only be "
                                 "predicted by copying, not recalled.")
    probe_questions: int = opt(100, "Held-out questions whose oracle trajectories ``turn_probe`` reads at every "
                                    "progress line (0: none). Never trained on.", hashed=False)
    export_to: str = opt("", "Also write the trained weights here as a float16 checkpoint with card.json (its held-out "
                             "loss on the probe's rows, as the committed policy's test checks it); e.g. "
                             "osvl/models/weights/tiny_policy. A finished run is reused, not trained again.",
                         hashed=False)
    log_every: int = opt(50, "Progress line (with the validation loss) every N steps.", hashed=False)
    threads: int = opt(2, "torch CPU threads.", hashed=False)

    def check(self) -> None:
        if min(self.steps, self.batch, self.max_len, self.val_rows) < 1 or self.lr <= 0:
            raise ConfigError("steps, batch, max_len, val_rows and lr must be positive")
        if min(self.embed_scale, self.copy_steps, self.keyed_steps, self.keyed_mix, self.probe_questions) < 0:
            raise ConfigError("embed_scale, copy_steps, keyed_steps, keyed_mix and probe_questions must be >= 0")
        if not self.keyed_links or not all(self.keyed_links):
            raise ConfigError(f"keyed_links must be non-empty strings, got {self.keyed_links}")
        if not 0.0 <= self.swap_share <= 1.0:
            raise ConfigError(f"swap_share must be in [0, 1], got {self.swap_share}")
        if self.export_to and not self.probe_questions:
            raise ConfigError("export_to needs probe_questions > 0: the exported card states the held-out loss")


def run(cfg: PretrainConfig, trajs: Callable[[], list[Any]], held: set[str], probe_trajs: Callable[[], list[Any]],
        extra: dict[str, Any]) -> dict[str, Any]:
    """Pretrain on the corpus of ``trajs()`` (the sft split's oracle trajectories) with everything about the ``held``
    entities cut out, or reuse the finished run (read nothing); ``probe_trajs()``: whole held-out trajectories, read
    by the progress lines' turn probe, never trained on; ``extra``: what the report records of the data recipe (its
    ``synth`` key is what an export's card states). Prints the closing lines; returns the report."""
    # lazy, (d): transformers takes seconds to import (jobs/grpo.py --help)
    from osvl.models.load import load_processor  # noqa: PLC0415

    base = Path(cfg.init) if cfg.init else tiny_checkpoint(BASE_KIND)
    tok = load_processor(base).tokenizer
    out = run_dir(cfg, JOB)
    if (out / "report.json").is_file() and (out / "model").is_dir():  # finished: rerun to export, not to train
        report = json.loads((out / "report.json").read_text())
        n_cut = report["rows_over_max_len"]
        print(f"pretrain_tiny: reusing the finished run {out}", flush=True)
    else:
        corpus = trajs()
        rows = corpus_rows(corpus, tok, held, cfg.max_len)
        # a row's answer is its last turn: a row cut at max_len never shows one (answers 0/96 at max_len 1024)
        n_cut = sum(len(r) > cfg.max_len for r in corpus_rows(corpus, tok, held, 1 << 16))
        probe = corpus_rows(probe_trajs(), tok, set(), 1 << 16)
        # the recipe as trained on: the profile may change before a later rerun exports this run
        report = train(cfg, rows, base, out, extra={**extra, "heldout_entities": len(held), "rows_over_max_len": n_cut},
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
