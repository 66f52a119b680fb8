"""The tiny policy's pretraining (jobs/pretrain_tiny.py): its corpus cuts held-out entities out, the loop lowers the
loss and leaves an ordinary checkpoint, from which a second run (``--init``) continues."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from osvl import chat as fmt
from osvl.errors import ConfigError
from osvl.models import pretrain, tiny
from osvl.models.job import PretrainConfig
from osvl.models.load import load_model, load_processor


def _trajectory(tok, hits: list[str]) -> SimpleNamespace:
    call = fmt.assistant_text("Search.", tool_call={"name": "text_search", "arguments": {"query": " Nairobi"}})
    seen = "Search results for \" Nairobi\":\n" + "\n".join(f"{i + 1}. {h}\n   A passage." for i, h in enumerate(hits))
    messages = [{"role": "user", "content": "What is the capital of the one whose capital is Nairobi?"},
                {"role": "assistant", "content": call}, {"role": "tool", "content": seen},
                {"role": "assistant", "content": fmt.assistant_text("Done.", response=" Nairobi")}]
    tools = [{"type": "function", "function": {"name": "text_search", "description": "Search text.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    ids = tok(fmt.render(messages, tools=tools), add_special_tokens=False)["input_ids"]
    return SimpleNamespace(input_ids=ids, turns=[SimpleNamespace(observation=seen), SimpleNamespace(observation="")])


def test_corpus_rows_drop_the_system_turn_and_cut_before_a_held_out_passage():
    tok = load_processor(tiny.tiny_checkpoint("qwen3_vl")).tokenizer
    clean, leaky = _trajectory(tok, ["Kenya", "Uganda"]), _trajectory(tok, ["Uganda", "Kenya"])
    kept = pretrain.corpus_rows([clean], tok, {"Tanzania"}, 10_000)
    text = tok.decode(kept[0])
    assert text.startswith("<|im_start|>user\nWhat is the capital") and "system" not in text
    assert "1. Kenya" in text and text.rstrip().endswith("</response><|im_end|>")
    cut = pretrain.corpus_rows([leaky], tok, {"Kenya"}, 10_000)
    assert len(cut) == 1 and "Kenya" not in tok.decode(cut[0]) and "Uganda" not in tok.decode(cut[0])
    assert tok.decode(cut[0]).rstrip().endswith("</tool_call><|im_end|>")  # the call stays, its answer goes
    assert len(pretrain.corpus_rows([clean], tok, set(), 60)[0]) == 60
    assert pretrain.corpus_rows([clean], tok, set(), 12) == []  # cut inside the question: nothing to learn to say


def test_swap_spans_replaces_every_copied_span_consistently_and_keeps_the_rows_structure():
    """A swapped row is still a demonstration: the query repeats the question's clause value, the tool response
    lists the same hits, the answer reads off the response; only the copied words are new."""
    import random

    tok = load_processor(tiny.tiny_checkpoint("qwen3_vl")).tokenizer
    text = tok.decode(pretrain.corpus_rows([_trajectory(tok, ["Kenya", "Uganda"])], tok, set(), 10_000)[0])
    assert pretrain.copy_spans(text) == {"Nairobi": "value", "Kenya": "name", "Uganda": "name"}
    pool = {"value": ["Lake Victoria (UTC+3)"], "name": ["Ada Lovelace", "Ada Lovelace"]}
    swapped = pretrain.swap_spans(text, pool, random.Random(0))
    assert "Nairobi" not in swapped and "Kenya" not in swapped and "Uganda" not in swapped
    assert swapped.count("Lake Victoria (UTC+3)") == text.count("Nairobi") == 4
    assert swapped.replace("Lake Victoria (UTC+3)", "Nairobi").replace("Ada Lovelace", "X") == \
        text.replace("Kenya", "X").replace("Uganda", "X")
    with_word = text.replace("capital of the one", "capital of the Nairobian one")
    assert "Nairobian" in pretrain.swap_spans(with_word, pool, random.Random(0))  # whole words only
    names_only = pretrain.swap_spans(text, {"name": ["Ada Lovelace"], "value": []}, random.Random(0))
    assert "Nairobi" in names_only and "Kenya" not in names_only  # a kind with nothing to draw stays as it is


def test_pretraining_lowers_the_loss_and_writes_a_checkpoint_sft_can_load(tmp_path):
    from osvl.config import RunConfig

    base = tiny.tiny_checkpoint("qwen3_vl")
    tok = load_processor(base).tokenizer
    rows = pretrain.corpus_rows([_trajectory(tok, [f"Place {i}"]) for i in range(6)], tok, set(), 10_000)
    cfg = PretrainConfig(run=RunConfig(root=str(tmp_path)), steps=12, batch=2, val_rows=2, lr=3e-3,
                                  log_every=6, swap_share=0.5, embed_scale=5.0, copy_steps=2,
                                  keyed_steps=2, keyed_links=[" is", ":"], keyed_mix=2)
    probe = pretrain.corpus_rows([_trajectory(tok, ["Held Out"])], tok, set(), 10_000)
    report = pretrain.train(cfg, rows, base, tmp_path, extra={"corpus": "six rows"}, log=lambda m: None, probe=probe)
    assert report["train_rows"] == 4 and [c["step"] for c in report["curve"]] == [0, 6, 12]
    assert all(set(c["heldout_turns"]) == {"search1", "answer"} for c in report["curve"][1:])  # read at every line
    assert report["heldout_turns"]["search1"][1] == 1 and report["heldout_turns"]["answer"][1] == 1
    assert report["val_loss"] < report["curve"][0]["val"] - 1  # the rows share most of their text
    model = load_model(tmp_path / "model", dtype="float32", device="cpu").eval()  # an ordinary checkpoint
    assert pretrain.val_loss(model, rows, int(model.config.text_config.pad_token_id)) < report["curve"][0]["val"] - 1
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    as_built = load_model(base, dtype="float32", device="cpu").get_input_embeddings().weight
    emb = model.get_input_embeddings().weight  # tied and scaled x5 before training, and saved so
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    assert 4 < float(emb.detach().std() / as_built.detach().std()) < 6
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["copy"]["of"] == 100 and 0 <= saved["copy"]["copied"] <= 100  # the synthetic phase ran and scored
    assert set(saved["keyed"]) == {"before_corpus", "after_corpus"} and saved["keyed"]["after_corpus"]["of"] == 100
    assert saved["corpus"] == "six rows" and set(saved["turns"]) == {"search1", "answer"}
    assert all(n == 2 for _, n in saved["turns"].values())  # two validation rows, one turn of each kind in each
    # `--export_to`: float16 weights, tied embeddings stored once, a card with the held-out loss; a data card kept
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "README.md").write_text("data card")
    card = pretrain.export(tmp_path / "model", tmp_path / "export", probe, {"steps": 12})
    assert (tmp_path / "export" / "README.md").read_text() == "data card"
    assert json.loads((tmp_path / "export" / "card.json").read_text()) == card and card["steps"] == 12
    half = (tmp_path / "export" / "model.safetensors").stat().st_size
    assert half < 0.55 * (tmp_path / "model" / "model.safetensors").stat().st_size
    pad = int(model.config.text_config.pad_token_id)
    assert abs(card["heldout_loss"] - pretrain.val_loss(model, probe, pad)) < 0.01  # float16 rounding only
    exported = load_model(tmp_path / "export", dtype="float32", device="cpu")
    assert exported.get_output_embeddings().weight.data_ptr() == exported.get_input_embeddings().weight.data_ptr()
    # `--init`: the job continues from such a checkpoint (no second tying or scaling) on the same validation rows
    more = PretrainConfig(run=RunConfig(root=str(tmp_path)), steps=2, batch=2, val_rows=2, lr=3e-3,
                                   log_every=2)
    with pytest.raises(ConfigError, match="embed_scale=0"):  # the profile's embed_scale would scale them twice
        pretrain.train(replace(more, embed_scale=5.0), rows, tmp_path / "model", tmp_path / "cont", log=lambda m: None)
    cont = pretrain.train(more, rows, tmp_path / "model", tmp_path / "cont", log=lambda m: None)
    assert abs(cont["curve"][0]["val"] - report["val_loss"]) < 1e-4  # it starts where the first run ended
    again = load_model(tmp_path / "cont" / "model", dtype="float32", device="cpu")
    emb = again.get_input_embeddings().weight
    assert again.get_output_embeddings().weight.data_ptr() == emb.data_ptr()  # still tied
    assert 4 < float(emb.detach().std() / as_built.detach().std()) < 6  # and not scaled twice


def test_turn_probe_counts_a_turn_only_when_every_greedy_token_is_right():
    """A model that repeats its input's next token (logits = one-hot of the true token) reproduces every turn;
    one that is wrong on a single token of the answer loses that turn and no other."""
    import torch

    tok = load_processor(tiny.tiny_checkpoint("qwen3_vl")).tokenizer
    row = pretrain.corpus_rows([_trajectory(tok, ["Kenya"])], tok, set(), 10_000)[0]
    answer_at = row.index(tok.convert_tokens_to_ids("<response>")) + 1

    class Oracle:
        def __init__(self, wrong_at=None):
            self.wrong_at = wrong_at

        def __call__(self, input_ids, use_cache):
            ids = input_ids[0].tolist()
            logits = torch.zeros(1, len(ids), len(tok))
            for i, nxt in enumerate(ids[1:] + [0]):
                logits[0, i, 0 if i + 1 == self.wrong_at else nxt] = 1.0
            return SimpleNamespace(logits=logits)

    assert pretrain.turn_probe(Oracle(), [row], tok) == {"search1": [1, 1], "answer": [1, 1]}
    assert pretrain.turn_probe(Oracle(answer_at), [row], tok) == {"search1": [1, 1], "answer": [0, 1]}


def test_split_titles_name_the_entities_each_split_walks_through(tmp_path):
    """What the corpus leaves out (every held-out entity) is the split the synthesizer walks held-out questions in;
    the demo's held-out seeds are disjoint from its development split's and from every split tuned on before."""
    import dataclasses

    from osvl.config import merge, parse_args
    from osvl.recipe import GRPOJobConfig
    from osvl.rl.job import JOB as GRPO_JOB
    from osvl.synth import pipeline
    from osvl.synth.walks import Graph

    grpo = parse_args(GRPOJobConfig, GRPO_JOB, ["--profile=demo"])
    cfg = dataclasses.replace(grpo.synth)
    cfg.questions_per_seed, cfg.attempts_per_seed = 4, 30
    held = pipeline.split_titles(cfg, "heldout")
    graph = Graph.load(None, max_answer_words=cfg.walk.max_answer_words)
    shards, split_of = pipeline.plan(graph, cfg)
    rows = [r for k in range(len(shards))
            for r in pipeline.synthesize_shard(graph, cfg, k, shards[k], split_of,
                                               pipeline.ImageStore(graph, tmp_path))[0]]
    splits = {r["split"] for r in rows}
    assert {"sft", "heldout", "dev"} <= splits
    for r in rows:
        titles = {p["title"] for p in r["path"]}
        assert titles <= held if r["split"] == "heldout" else not titles & held, (r["split"], titles)
    # held-out figures come from seeds no choice was tuned on: none is a dev seed, nor one of the held-out
    # seeds of the three-share profile every run until 2026-12-06 tuned on (now dev: the same seeds)
    seeds = {split: {r["path"][0]["title"] for r in rows if r["split"] == split} for split in splits}
    tuned_on = merge(grpo.synth, {"split_fractions": [0.45, 0.2, 0.35], "entity_split_fractions": [0.4, 0.25, 0.35]})
    old_held = pipeline.split_titles(tuned_on, "heldout")
    assert seeds["heldout"] and not seeds["heldout"] & (seeds["dev"] | old_held)
    assert seeds["dev"] <= old_held and not held & pipeline.split_titles(cfg, "dev")


def test_lm_loss_with_starts_counts_only_the_tokens_from_each_rows_start():
    """The synthetic copy rows' loss: only the copied span is predictable, so only it counts."""
    import random

    import torch

    base = tiny.tiny_checkpoint("qwen3_vl")
    model = load_model(base, dtype="float32", device="cpu").eval()
    pad = int(model.config.text_config.pad_token_id)
    rng = random.Random(0)
    (a, sa), (b, sb) = (pretrain.copy_row(rng, list(range(300, 400)), [7, 8]) for _ in range(2))
    assert a[sa - 2:sa] == [7, 8] and a[sa:] == a[a.index(7) + 2:a.index(7) + 2 + len(a) - sa]  # span copied
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([r]), use_cache=False).logits[0] for r in (a, b)]
        want = torch.cat([logits[0][sa - 1:-1], logits[1][sb - 1:-1]])
        target = torch.tensor(a[sa:] + b[sb:])
        expected = torch.nn.functional.cross_entropy(want, target)
        got = pretrain.lm_loss(model, [a, b], pad, [sa, sb])
        every = pretrain.lm_loss(model, [a, b], pad)
    assert abs(float(got) - float(expected)) < 1e-4
    assert abs(float(every) - float(got)) > 1e-3  # without starts: every token counts


def test_keyed_rows_end_with_one_records_value_after_its_key_and_the_shared_link():
    """A keyed row's copy is the value that followed the same key and link earlier in the row, and the link
    alone does not give it away: it follows every key (and sometimes filler)."""
    import random

    rng = random.Random(3)
    vocab, link, marker = list(range(300, 4000)), [5], [7, 8]
    for _ in range(200):
        row, start = pretrain.keyed_row(rng, vocab, link, marker)
        value, m = row[start:], start - 1
        while row[m - len(marker):m] != marker:  # the key runs from after the last marker to the link
            m -= 1
        key = row[m:start - 1]
        assert row[start - 1] == 5 and 1 <= len(key) <= 3 and 2 <= len(value) <= 6
        head = row[:m - len(marker)]
        hits = [i for i in range(len(head)) if head[i:i + len(key) + 1] == key + link]
        assert any(head[i + len(key) + 1:i + len(key) + 1 + len(value)] == value for i in hits)
        assert head.count(5) >= 2  # at least two records: " is" alone is ambiguous


@pytest.mark.slow
def test_the_committed_policy_reproduces_its_documented_heldout_loss(ray_cluster, tmp_path):
    """The demo's base, ``osvl/models/weights/tiny_policy``: float16 and small, the tiny model's tokenizer, and on
    the oracle's trajectories of the held-out questions (rebuilt here with the job's own function; the job's
    corpus cut every held-out passage out) the loss its card and data card state."""
    from osvl.agent.trajectory import read_trajectories
    from osvl.config import RunConfig
    from osvl.recipe import demo_trajectories, grpo_recipe

    card = json.loads((pretrain.POLICY / "card.json").read_text())
    assert (pretrain.POLICY / "model.safetensors").stat().st_size <= 5 * 1024 * 1024 and card["dtype"] == "float16"
    assert f"{card['heldout_loss']:.4f}" in (pretrain.POLICY / "README.md").read_text()
    tok = load_processor(pretrain.POLICY).tokenizer
    assert tok.get_vocab() == load_processor(tiny.tiny_checkpoint(pretrain.BASE_KIND)).tokenizer.get_vocab()
    model = load_model(pretrain.POLICY, dtype="float32", device="cpu").eval()
    path, held = demo_trajectories(RunConfig(root=str(tmp_path)), grpo_recipe(card["grpo_profile"]), "heldout",
                                   card["heldout_questions"], card["synth"])
    rows = pretrain.corpus_rows(read_trajectories(path), tok, set(), 1 << 16)
    assert len(rows) >= 0.8 * card["heldout_questions"] and held  # the questions the oracle got right
    loss = pretrain.val_loss(model, rows, int(model.config.text_config.pad_token_id))
    # 3.0893 where it was exported, 3.0802 on another machine (2026-12-04, the exporting commit too; not pinned
    # down, the rows are rebuilt through the real search); the SFT'd or a random policy misses by far more
    assert abs(loss - card["heldout_loss"]) < 0.015, (loss, card["heldout_loss"])


def test_the_run_hash_follows_the_profiles_recipe_not_its_name(tmp_path):
    """A finished pretraining run is reused by its config hash: a GRPO profile whose synth or trajectories
    section changed must get a new run (before, the hash saw only the profile's name, and a rerun reused a
    model pretrained on the old recipe); a copy under another name that changes only other sections reuses it."""
    import yaml

    from osvl.config import CONFIG_DIR, config_hash

    demo = yaml.safe_load((CONFIG_DIR / "grpo" / "demo.yaml").read_text())
    same = tmp_path / "renamed.yaml"
    same.write_text(yaml.safe_dump({**demo, "rl": {**demo["rl"], "lr": 1e-6}}))
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump({**demo, "synth": {**demo["synth"], "rewriter": {"key_case": "lower"}}}))

    def run_hash(profile: str) -> str:
        return config_hash(PretrainConfig(grpo_profile=profile))

    assert run_hash(str(same)) == run_hash("demo")
    assert run_hash(str(changed)) != run_hash("demo")
