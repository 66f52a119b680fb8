"""Pretraining the tiny demo policy to copy (``jobs/pretrain_tiny.py``).

Why: the 2.3M-parameter tiny Qwen3-VL fine-tuned from random weights on a few hundred oracle
trajectories learns the format and never copies. Teacher-forced on held-out trajectories, every
query's first name token was wrong (it wrote the most frequent word instead), so no episode ever
reached an answer (Pass@1 0.000; docs/design.md, "The demo policy"). Copying a span the model has
never seen is an induction-head skill, and induction heads take more tokens to form than the
demo's SFT sees. This job gives the model those tokens once, offline; SFT then starts from its
checkpoint (``--sft.model``).

Corpus: oracle trajectories (``osvl.expert``) of every question of the synthesize run's
``sft`` split, with the demo's data recipe (the GRPO demo profile's ``synth`` and
``trajectories`` sections: 2-hop, fixed wording, a space before each copied span), read as
plain text. Each row is one trajectory's tokens after the system prompt (the same 600 tokens in
every row teach nothing), with image placeholder tokens removed (the text model sees no
pixels here), next-token loss on every token: a tool response that repeats the query, a query
that repeats the question, an answer read off a response are all copies. Rows that show a
passage of a held-out entity are cut before it (``corpus_rows``), so no passage the held-out
questions' answers are read from is in the corpus (a name can still appear in another entity's text).

With ``swap_share`` a share of rows has its copied spans swapped for other rows' (``swap_spans``),
so that a copy cannot be recalled from the corpus. Neither that nor more steps made the tiny model
as built copy whole spans: with untied embeddings at std 0.02 its induction heads form only after a
plateau far longer than this corpus. ``embed_scale`` ties the output embeddings to the input ones
and scales them (``tie_and_scale``), after which ``copy_steps`` of synthetic span copies
(``copy_row``) form the head in a few minutes, before the corpus. ``keyed_steps`` of keyed copies
(``keyed_row``) follow: the value after "key is" where " is" follows every key, so the copy must
find the key as well, which is what a query copying the question's "currency is X" clause needs
(docs/design.md, "The demo policy", has the measurements); ``keyed_links`` adds ":" as in the
passages' "Key: value." lines an answer is read from, and ``keyed_mix`` keeps such rows in every
corpus batch, since the corpus alone erases the skill.

Training: plain AdamW with warm-up and cosine decay in one process (the model is small enough
that data parallelism does not pay on a CPU machine), a fixed share of rows held out for the
validation loss. Output: ``model/``, an ordinary checkpoint directory (the base's tokenizer and
processor files, the trained weights), and ``report.json`` (corpus size, loss curve, the final
validation loss, the validation turns greedy decoding reproduces whole: ``turn_probe``, and the same
on oracle trajectories of held-out questions, the figure that predicts Pass@1) in the run folder.
No resume: a killed run starts again (~100 minutes on 2 cores at the demo profile).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osvl.errors import ConfigError
from osvl.logs import Progress

if TYPE_CHECKING:
    from osvl.models.job import PretrainConfig

logger = logging.getLogger(__name__)

BASE_KIND = "qwen3_vl"  # the tiny kind pretrained: its tokenizer renders the records, and the checkpoint keeps it
# The committed checkpoint of this job (fp16, its data card README.md and card.json beside it): the demo's base.
POLICY = Path(__file__).with_name("weights") / "tiny_policy"
# a search hit as the tools print it: "3. Title" (text_search) or "1. Title — snippet" (image_search)
HIT = re.compile(r"^\s*\d+\. (.+?)(?: — .*)?$", re.M)
# spans of the question an agent copies into its queries: a clause's value ("whose currency is CFP franc
# (XPF) mentioned in") and a fuzzy description ("on the British explorer (1728–1779) mentioned in")
CLAUSE = re.compile(r"whose .+? is (.+?) (?=mentioned in|that is)")
DESC = re.compile(r"(?:on|of) the (?!one whose)(.+?) (?=mentioned in the article)")
ANSWER = re.compile(r"<response>\s?(.+?)</response>")
FIRST_ORDINARY = 300  # token ids below are bytes, special tokens and the most frequent merges: no copy spans


def shown_titles(text: str) -> set[str]:
    """The entity titles a tool response lists as hits."""
    return {m.group(1).strip() for m in HIT.finditer(text)}


def corpus_rows(trajs: Iterable[Any], tokenizer: Any, held: set[str], max_len: int) -> list[list[int]]:
    """One token row per trajectory: after the system turn, without image placeholders, cut before the first
    tool response that lists a held-out entity (and at ``max_len``); rows with no assistant turn left are
    dropped."""
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rows = []
    for t in trajs:
        ids = list(t.input_ids)
        if tokenizer.decode(ids[:4]).startswith("<|im_start|>system"):
            ids = ids[ids.index(im_end) + 2:]  # drop "<|im_start|>system ... <|im_end|>\n"
        # turn k's tool response is the (k+2)-th "<|im_start|>" from here: user, assistant, tool, assistant, ...
        starts = [i for i, x in enumerate(ids) if x == im_start]
        for k, turn in enumerate(t.turns):
            if turn.observation and shown_titles(turn.observation) & held:
                ids = ids[:starts[2 * k + 2]] if 2 * k + 2 < len(starts) else ids
                break
        ids = [x for x in ids if x != pad][:max_len]
        if len(starts) > 1 and len(ids) > starts[1]:
            rows.append(ids)
    return rows


def copy_spans(text: str) -> dict[str, str]:
    """The spans of a rendered trajectory an agent copies, each with its kind: ``value`` (a clause's value,
    the answer) or ``name`` (a description in the question, a hit's title)."""
    question = text.split("<|im_end|>", 1)[0]
    spans = {m.group(1).strip(): "name" for m in HIT.finditer(text)}
    spans.update({m.group(1).strip(): "name" for m in DESC.finditer(question)})
    spans.update({m.group(1).strip(): "value" for m in CLAUSE.finditer(question)})
    spans.update({m.group(1).strip(): "value" for m in ANSWER.finditer(text)})
    return {k: v for k, v in spans.items() if len(k) > 1}


def swap_spans(text: str, pool: dict[str, list[str]], rng: random.Random) -> str:
    """``text`` with every copied span replaced, at each occurrence, by a span of the same kind drawn from
    ``pool``: the row stays a valid demonstration (each query still repeats what it repeated, each answer
    still reads off the response) whose copied words no longer recall anything."""
    new = {k: rng.choice(pool[kind]) for k, kind in copy_spans(text).items() if pool.get(kind)}
    if not new:
        return text
    # longest first, whole words only, one pass: a swapped-in span is never swapped again
    alt = "|".join(re.escape(k) for k in sorted(new, key=len, reverse=True))
    return re.sub(rf"(?<!\w)(?:{alt})(?!\w)", lambda m: new[m.group(0)], text)


def copy_row(rng: random.Random, vocab: list[int], marker: list[int]) -> tuple[list[int], int]:
    """A synthetic copy row and the index where its copied span starts: 5-30 random tokens, ``marker``, a
    span of 3-8 random tokens, 5-30 more, ``marker``, the span again. Only an induction head (attend to what
    followed the earlier ``marker``, then to what followed each copied token) predicts the second span."""
    span = [rng.choice(vocab) for _ in range(rng.randint(3, 8))]
    a, b = ([rng.choice(vocab) for _ in range(rng.randint(5, 30))] for _ in range(2))
    head = a + marker + span + b + marker
    return head + span, len(head)


def keyed_row(rng: random.Random, vocab: list[int], link: list[int], marker: list[int]) -> tuple[list[int], int]:
    """A synthetic keyed-copy row and the index where its copied value starts: 2-5 records "key ``link``
    value" (keys 1-3 random tokens, values 2-6) in random filler that holds ``link`` too, then ``marker``, one
    record's key and ``link``, and its value again. The token before the value (``link``) follows every key,
    so a one-token induction head cannot tell which value comes next: the copy needs the key as well, the way
    an agent copies "currency is X" out of a question in which " is" occurs several times."""
    def draw(lo: int, hi: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(rng.randint(lo, hi))]

    recs = [(draw(1, 3), draw(2, 6)) for _ in range(rng.randint(2, 5))]
    row: list[int] = []
    for key, value in recs:
        fill = draw(0, 12)
        if rng.random() < 0.5:
            at = rng.randint(0, len(fill))
            fill[at:at] = link
        row += fill + key + link + value
    row += draw(0, 12)
    key, value = rng.choice(recs)
    row += marker + key + link
    return row + value, len(row)


Rows = Callable[[random.Random], tuple[list[int], int]]  # a synthetic row maker: (row, where its copy starts)


def copy_train(model: Any, steps: int, make_row: Rows, rng: random.Random, log: Callable[[str], None] = logger.info,
               batch: int = 32, lr: float = 1e-3, name: str = "copy") -> None:
    """``steps`` AdamW steps on fresh ``make_row`` batches (``copy_row``, ``keyed_row``), loss on the copies only."""
    pad_id = int(model.config.text_config.pad_token_id)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        rows, starts = zip(*(make_row(rng) for _ in range(batch)), strict=True)
        loss = lm_loss(model, list(rows), pad_id, list(starts))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if (step + 1) % 250 == 0 or step + 1 == steps:
            log(f"{name} step {step + 1}/{steps} | {name} loss {loss.item():.3f} | {time.perf_counter() - t0:.0f} s")


def copy_score(model: Any, make_row: Rows, rng: random.Random, n: int = 100) -> dict[str, Any]:
    """On ``n`` fresh ``make_row`` rows: the mean copy loss and how many copies greedy decoding makes whole."""
    model.eval()
    copied, total = 0, 0.0
    with torch.no_grad():
        for _ in range(n):
            row, start = make_row(rng)
            logits = model(input_ids=torch.tensor([row]), use_cache=False).logits[0, start - 1:-1]
            want = torch.tensor(row[start:])
            copied += bool((logits.argmax(-1) == want).all())
            total += float(torch.nn.functional.cross_entropy(logits, want))
    return {"copy_loss": round(total / n, 4), "copied": copied, "of": n}


def tie_and_scale(model: Any, scale: float) -> None:
    """Tie ``model``'s output embeddings to its input embeddings, scaled by ``scale``, in place. One copy
    circuit then serves every token, seen in training or not: the logit of x for a residual carrying e_x is
    |e_x|^2; the scale makes those logits sharp enough to learn from (at std 0.02 they are not)."""
    emb = model.get_input_embeddings()
    if model.get_output_embeddings().weight is emb.weight:  # a checkpoint of this job (``init``): scaled already
        raise ConfigError(f"the model's embeddings are tied already, so it has been scaled once: set embed_scale=0 "
                          f"to continue from it (embed_scale={scale} would scale them again)")
    with torch.no_grad():
        emb.weight.mul_(scale)
    model.config.tie_word_embeddings = True
    model.config.text_config.tie_word_embeddings = True
    model.get_output_embeddings().weight = emb.weight


def turn_probe(model: Any, rows: list[list[int]], tokenizer: Any) -> dict[str, list[int]]:
    """Per kind of assistant turn (``image_search``, ``search1``, ``search2+``, ``answer``): [turns greedy
    decoding reproduces token for token from the true prefix, turns]. A copy is only useful whole: this
    counts what the token-averaged loss hides (the first token of a span wrong, the rest right)."""
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: dict[str, list[int]] = {}
    with torch.no_grad():
        for row in rows:
            pred = model(input_ids=torch.tensor([row]), use_cache=False).logits[0].argmax(-1).tolist()
            searches = 0
            for i in range(len(row) - len(head)):
                if row[i:i + len(head)] != head or end not in row[i + len(head):]:
                    continue  # not a turn start, or a turn the row cuts off
                a = i + len(head)
                b = row.index(end, a)
                text = tokenizer.decode(row[a:b])
                kind = "image_search" if "image_search" in text else "answer" if "<response>" in text else None
                if kind is None:
                    searches += 1
                    kind = "search1" if searches == 1 else "search2+"
                tally = out.setdefault(kind, [0, 0])
                tally[0] += pred[a - 1:b - 1] == row[a:b]
                tally[1] += 1
    return out


def turns_text(turns: dict[str, list[int]]) -> str:
    """``turn_probe``'s tally as one log phrase: "image_search 96/96 search1 28/96 ..."."""
    return " ".join(f"{k} {a}/{n}" for k, (a, n) in turns.items())


def lr_at(step: int, cfg: PretrainConfig) -> float:
    warm = max(1, int(cfg.warmup_share * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def lm_loss(model: Any, rows: list[list[int]], pad_id: int, starts: list[int] | None = None) -> Any:
    """Mean next-token cross-entropy over the real tokens of ``rows`` (right-padded); with ``starts``, over
    each row's tokens from its ``starts[i]`` on (a synthetic copy row's copied span)."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        att[i, :len(r)] = 1
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()
    keep = att.clone()
    for i, start in enumerate(starts or []):
        keep[i, :start] = 0
    target = ids[:, 1:].masked_fill(keep[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def val_loss(model: Any, rows: list[list[int]], pad_id: int, chunk: int = 16) -> float:
    """Token-weighted validation loss over ``rows`` (in chunks, no gradient)."""
    total = n = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            part = rows[i:i + chunk]
            toks = sum(len(r) - 1 for r in part)
            total += float(lm_loss(model, part, pad_id)) * toks
            n += toks
    return total / n


def export(model_dir: Path, dest: Path, probe: list[list[int]], card: dict[str, Any]) -> dict[str, Any]:
    """Write checkpoint ``model_dir`` to ``dest`` with float16 weights (half the bytes; the tiny model's
    tied embeddings are stored once) and ``card.json``: ``card`` plus ``heldout_loss``, the token-weighted
    loss of the float16 weights on ``probe`` (rows never trained on), the figure the committed policy's
    test reproduces. Returns the card."""
    from osvl.models.load import load_model  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    model = load_model(model_dir, dtype="float32", device="cpu").eval()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.safetensors*"):  # a sharded or older export must not be loaded beside the new one
        old.unlink()
    # the folder's README.md is its data card, written by hand from card.json: kept
    shutil.copytree(model_dir, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*", "README.md"))
    model.to(torch.float16).save_pretrained(dest)
    again = load_model(dest, dtype="float32", device="cpu").eval()  # what a user loads: fp16 weights, upcast
    card = {**card, "dtype": "float16", "parameters": sum(p.numel() for p in again.parameters()),
            "heldout_loss": val_loss(again, probe, int(again.config.text_config.pad_token_id)) if probe else None}
    (dest / "card.json").write_text(json.dumps(card, indent=1))
    return card


def _swapper(cfg: PretrainConfig, rows: list[list[int]], tok: Any,
             rng: random.Random) -> Callable[[list[int]], list[int]]:
    """The batch-time row transform: ``swap_spans`` on a ``swap_share`` of rows (re-tokenized), the pool being
    the training rows' own spans."""
    if cfg.swap_share == 0:
        return lambda row: row
    pool: dict[str, set[str]] = {"name": set(), "value": set()}
    for row in rows:
        for span, kind in copy_spans(tok.decode(row)).items():
            pool[kind].add(span)
    lists = {k: sorted(v) for k, v in pool.items()}

    def swap(row: list[int]) -> list[int]:
        if rng.random() >= cfg.swap_share:
            return row
        return tok.encode(swap_spans(tok.decode(row), lists, rng), add_special_tokens=False)[:cfg.max_len]
    return swap


def train(cfg: PretrainConfig, rows: list[list[int]], base: Path, out: Path, extra: dict[str, Any] | None = None,
          log: Callable[[str], None] = logger.info, probe: list[list[int]] | None = None) -> dict[str, Any]:
    """Pretrain ``base``'s weights on ``rows``; writes the checkpoint ``out/model`` and ``out/report.json``
    (with ``extra``'s keys added); returns the report. ``probe``: rows never trained on (oracle trajectories
    of held-out questions) that ``turn_probe`` reads at every progress line as well as the validation rows:
    validation rows are about entities the training rows show, so they overstate held-out skill."""
    # lazy: (d) keeps transformers out of jobs/grpo.py --help
    from osvl.models.load import load_model, load_processor  # noqa: PLC0415

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    val = [rows[i] for i in order[:cfg.val_rows]]
    train_rows = [rows[i] for i in order[cfg.val_rows:]]
    if not train_rows:
        raise ConfigError(f"{len(rows)} corpus rows leave none to train on after {cfg.val_rows} validation rows")
    model = load_model(base, dtype="float32", device="cpu").train()
    tok = load_processor(base).tokenizer  # swaps re-tokenize rows; the turn probe reads turns
    if cfg.embed_scale:
        tie_and_scale(model, cfg.embed_scale)
    vocab = list(range(FIRST_ORDINARY, tok.vocab_size))
    marker = tok.encode(' "query":', add_special_tokens=False)
    links = [tok.encode(t, add_special_tokens=False) for t in cfg.keyed_links]

    def copies(r: random.Random) -> tuple[list[int], int]:
        return copy_row(r, vocab, marker)

    def keyed(r: random.Random) -> tuple[list[int], int]:
        # one link draws nothing: the rows stay those of runs before keyed_links
        return keyed_row(r, vocab, links[r.randrange(len(links))] if len(links) > 1 else links[0], marker)

    def mixed(r: random.Random) -> tuple[list[int], int]:
        return keyed(r) if r.random() < 0.7 else copies(r)
    copy_rng = random.Random(cfg.run.seed + 1)  # the corpus batches stay those of a run without these phases
    copy: dict[str, Any] = {}
    if cfg.copy_steps:
        copy_train(model, cfg.copy_steps, copies, copy_rng, log)
        copy = copy_score(model, copies, copy_rng)
        log(f"pretrain: fresh synthetic spans copied whole {copy['copied']}/{copy['of']}, "
            f"copy loss {copy['copy_loss']:.3f}")
    keyed_scores: dict[str, Any] = {}
    if cfg.keyed_steps:
        copy_train(model, cfg.keyed_steps, mixed, copy_rng, log, name="keyed")
        keyed_scores["before_corpus"] = copy_score(model, keyed, copy_rng)
        log("pretrain: fresh keyed values copied whole {copied}/{of}".format(**keyed_scores["before_corpus"]))
    model.train()
    swap = _swapper(cfg, train_rows, tok, rng)
    pad_id = int(model.config.text_config.pad_token_id)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    queue: list[int] = []
    curve = [{"step": 0, "val": val_loss(model, val, pad_id)}]
    t0 = time.perf_counter()
    with Progress(cfg.steps, "pretrain", "steps") as bar:
        for step in range(cfg.steps):
            if len(queue) < cfg.batch:
                more = list(range(len(train_rows)))
                rng.shuffle(more)
                queue += more
            batch = [swap(train_rows[queue.pop()]) for _ in range(cfg.batch)]
            for group in optim.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = lm_loss(model, batch, pad_id)
            total = loss
            if cfg.keyed_mix:
                synth, starts = zip(*(mixed(copy_rng) for _ in range(cfg.keyed_mix)), strict=True)
                total = loss + lm_loss(model, list(synth), pad_id, list(starts))
            optim.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            bar.update(1, loss=loss.item())
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                model.eval()
                point = {"step": step + 1, "loss": loss.item(), "val": val_loss(model, val, pad_id),
                         "turns": turn_probe(model, val, tok)}
                if probe:
                    point["heldout_turns"] = turn_probe(model, probe, tok)
                model.train()
                curve.append(point)
                held_out = f" | held-out {turns_text(point['heldout_turns'])}" if probe else ""
                log(f"pretrain step {step + 1}/{cfg.steps} | loss {loss.item():.4f} | val {point['val']:.4f} | "
                    f"whole turns {turns_text(point['turns'])}{held_out} | {time.perf_counter() - t0:.0f} s")
    model.eval()
    turns = curve[-1]["turns"]
    if cfg.keyed_steps:  # what the corpus left of the keyed skill
        keyed_scores["after_corpus"] = copy_score(model, keyed, copy_rng)
    shutil.copytree(base, out / "model", dirs_exist_ok=True)  # tokenizer, processor, generation config
    model.save_pretrained(out / "model")
    report = {"rows": len(rows), "train_rows": len(train_rows), "val_rows": len(val),
              "tokens": sum(map(len, rows)), "steps": cfg.steps, "batch": cfg.batch, "max_len": cfg.max_len,
              "seconds": round(time.perf_counter() - t0, 1), "val_loss": curve[-1]["val"], "curve": curve,
              "turns": turns, "heldout_turns": curve[-1].get("heldout_turns", {}), "copy": copy,
              "keyed": keyed_scores, "model": str(out / "model"), **(extra or {})}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report
