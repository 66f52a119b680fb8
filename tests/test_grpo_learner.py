"""The learner computes logits only where a generated token is predicted: same log-probs and entropy as the full
forward there, zeros elsewhere, and no logits for prompt, tool or padding positions."""

from __future__ import annotations

import torch

from osvl.models.load import load_model
from osvl.models.tiny import tiny_checkpoint
from osvl.rl.learner import forward_logprobs, scored_positions, token_entropy
from osvl.train.batch import model_inputs, token_logprobs


def test_logprobs_only_at_generated_positions_match_the_full_forward():
    model = load_model(tiny_checkpoint("qwen3_vl"), dtype="float32").eval()
    g = torch.Generator().manual_seed(0)
    lengths, width = [40, 31, 12], 40
    ids = torch.randint(10, 1000, (3, width), generator=g)
    attn = torch.zeros(3, width, dtype=torch.long)
    gen = torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    gen[0, 10:18] = gen[0, 25:40] = 1  # two assistant turns
    gen[1, 20:31] = 1
    gen[1, 0] = 1                       # the first token has no context: never scored
    # row 2: a prompt only, nothing generated
    batch = {"input_ids": ids, "attention_mask": attn, "gen_mask": gen}
    at = scored_positions(gen)
    assert int(at.sum()) == 8 + 15 + 11 and not at[:, 0].any()

    with torch.no_grad():
        logp, logits = forward_logprobs(model, batch)
        full = token_logprobs(model, batch)
        full_logits = model(**model_inputs(batch), use_cache=False).logits.float()
    assert logits.shape == (int(at.sum()), model.config.text_config.vocab_size)
    assert torch.allclose(logp[at], full[at], atol=1e-5)
    assert torch.all(logp[~at] == 0)

    # the entropy guard over the kept rows equals the one over the same positions of the full logits
    rows = torch.nn.functional.pad(at[:, 1:], (0, 1))  # logits at t predict token t + 1
    ref = torch.log_softmax(full_logits[rows], dim=-1)
    want = float(-(ref.exp() * ref).sum(-1).mean())
    assert abs(token_entropy(logits, torch.ones(len(logits))) - want) < 1e-4
    assert token_entropy(logits, torch.zeros(len(logits))) == 0.0
