"""The four ablation modes on one fixed batch holding fatal trajectories, through the real tiny VLM.

The gradient of the loss with respect to each token's log-prob says exactly which
tokens the mode trains and with what weight; it is compared with docs/design.md's
per-mode table: ``vanilla`` trains post-fatal tokens, ``fatal_mask`` does not,
``hard_mask`` gives a fatal trajectory no gradient at all, and the clamp turns a
fatal trajectory's negative advantage into 0 while a positive one is kept.
"""

from __future__ import annotations

import copy

import pytest
import torch

from osvl.chat import assistant_text, tool_call_text, tool_error_text
from osvl.models.load import load_model, load_tokenizer
from osvl.models.tiny import tiny_checkpoint
from osvl.rl.learner import RLConfig, forward_logprobs, grpo_loss, mask_starts

pytestmark = pytest.mark.slow  # ~12 s: loads the tiny VLM, five forward+backward passes

OK_CALL = assistant_text("look it up", tool_call={"name": "text_search", "arguments": {"query": "Eiffel Tower"}})
BAD_CALL = "<think>again</think><tool_call>{not json</tool_call>"
ANSWER = assistant_text("done", response="1832")


def _trajectory(tok, turns: list[tuple[str, str]]) -> tuple[list[int], list[int], list[int]]:
    """Token ids, generation mask and step ids of a text-only episode: prompt, then (assistant, tool) pairs."""
    ids: list[int] = []
    gen: list[int] = []
    step: list[int] = []

    def add(text: str, g: int, s: int) -> None:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(t)
        gen.extend([g] * len(t))
        step.extend([s] * len(t))

    add("<|im_start|>user\nWhen was the architect of the tower born?<|im_end|>\n<|im_start|>assistant\n", 0, -1)
    for i, (said, answer) in enumerate(turns):
        add(said, 1, i)
        add("<|im_end|>\n", 0, -1)
        if answer:
            add(f"<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                0, -1)
    return ids, gen, step


@pytest.fixture(scope="module")
def model_and_batch():
    path = tiny_checkpoint("qwen3_vl")
    tok = load_tokenizer(path)
    model = load_model(path, dtype="float32")
    err = tool_error_text("invalid_call", "bad JSON")
    fatal = [(OK_CALL, "1. Eiffel Tower"), (BAD_CALL, err), (BAD_CALL, err), (BAD_CALL, "")]  # cascade 1..3
    good = [(OK_CALL, "1. Eiffel Tower"), (ANSWER, "")]
    wrong = [(tool_call_text("crop", {"image": "img_1"}), "Cropped img_1"), (assistant_text("x", response="1900"), "")]
    # Two groups of 4; row 0 and row 4 are fatal. Group 0: the fatal row has the lowest reward (its
    # normalised reward is negative -> clamped to 0). Group 1: everyone else scored 0, the fatal row
    # kept some format/query reward, so its normalised reward is positive (kept by the clamp).
    rows = [fatal, good, wrong, good, fatal, wrong, wrong, wrong]
    rewards = [0.0, 1.0, 0.2, 0.8, 0.05, 0.0, 0.0, 0.0]
    seqs = [_trajectory(tok, r) for r in rows]
    n = max(len(s[0]) for s in seqs)
    pad = tok.pad_token_id

    def padded(i: int, v: int) -> list[list[int]]:
        return [s[i] + [v] * (n - len(s[i])) for s in seqs]

    batch = {
        "input_ids": torch.tensor(padded(0, pad)),
        "attention_mask": torch.tensor([[1] * len(s[0]) + [0] * (n - len(s[0])) for s in seqs]),
        "gen_mask": torch.tensor(padded(1, 0)),
        "step_ids": torch.tensor(padded(2, -1)),
        "reward": torch.tensor(rewards),
        "group": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        "fatal": torch.tensor([r is fatal for r in rows]),
        "mask_start": mask_starts([1 if r is fatal else -1 for r in rows], [3 if r is fatal else -1 for r in rows],
                                  "cascade"),
    }
    return model, batch


def _token_grads(model, batch, mode: str):
    model.zero_grad(set_to_none=True)
    logp, _ = forward_logprobs(model, batch)
    logp.retain_grad()
    # behaviour = current policy: every ratio is 1, so each token's gradient is -A_i / (B * n_i)
    b = dict(batch, old_logprobs=logp.detach())
    sl = grpo_loss(logp, b, RLConfig(mode=mode, beta=0.0))
    sl.out.loss.backward()
    return logp.grad, sl


def _parts(batch, row: int):
    gen = batch["gen_mask"][row].bool()
    step = batch["step_ids"][row]
    return gen & (step < 1), gen & (step >= 1), ~gen  # pre-fatal model tokens, post-fatal, not generated


def test_four_modes_gradients_match_the_table(model_and_batch):
    model, batch = model_and_batch
    grads = {m: _token_grads(model, batch, m) for m in ("vanilla", "hard_mask", "fatal_mask", "fatal_mask_clamp")}
    pre, post, other = _parts(batch, 0)
    pre4, post4, _ = _parts(batch, 4)
    for mode, (g, _) in grads.items():
        assert torch.all(g[0][other] == 0) and torch.all(g[2][~batch["gen_mask"][2].bool()] == 0), mode
        assert torch.all(g[1][batch["gen_mask"][1].bool()] != 0), f"{mode}: a non-fatal row must be trained"

    g, sl = grads["vanilla"]
    assert torch.all(g[0][post] != 0) and torch.all(g[0][pre] != 0)
    assert sl.raw_adv[0] < 0 and sl.adv[0] == sl.raw_adv[0]

    g, _ = grads["fatal_mask"]
    assert torch.all(g[0][post] == 0) and torch.all(g[0][pre] != 0)
    assert torch.all(g[4][post4] == 0) and torch.all(g[4][pre4] != 0)

    g, _ = grads["hard_mask"]
    assert torch.all(g[0] == 0) and torch.all(g[4] == 0)

    g, sl = grads["fatal_mask_clamp"]
    assert sl.raw_adv[0] < 0 and sl.adv[0] == 0 and torch.all(g[0] == 0)  # negative -> 0: no gradient
    assert sl.raw_adv[4] > 0 and sl.adv[4] == sl.raw_adv[4]                 # positive kept
    assert torch.all(g[4][pre4] != 0) and torch.all(g[4][post4] == 0)
    assert (sl.clamped, sl.kept_positive, sl.n_fatal) == (1, 1, 2)
    # exact per-token weight of the paper's aggregation: -A_i / (B * n_i) on each trained token
    expected = -sl.adv[4] / (8 * pre4.sum())
    assert torch.allclose(g[4][pre4], expected.expand(int(pre4.sum())), rtol=1e-5)
    # group statistics are over all G in every mode (the clamp and the drop come after)
    assert torch.equal(grads["vanilla"][1].raw_adv, sl.raw_adv)


def test_hard_mask_parameter_gradient_ignores_the_fatal_rows(model_and_batch):
    """Changing a dropped fatal trajectory's tokens changes no parameter gradient (its reward still sets the
    baseline, so it is kept fixed)."""
    model, batch = model_and_batch

    def param_grads(b):
        model.zero_grad(set_to_none=True)
        logp, _ = forward_logprobs(model, b)
        grpo_loss(logp, dict(b, old_logprobs=logp.detach()), RLConfig(mode="hard_mask", beta=0.0)).out.loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    base = param_grads(batch)
    ids = batch["input_ids"].clone()
    gen0 = batch["gen_mask"][0].bool()
    ids[0][gen0] = (ids[0][gen0] + 7) % 1000
    changed = param_grads(dict(batch, input_ids=ids))
    assert torch.allclose(base, changed, atol=1e-7)


def test_non_finite_step_is_skipped_and_bounds_stop_the_run(model_and_batch):
    """A NaN reward makes the loss NaN: the step is skipped and counted, the weights are untouched.
    Entropy outside its bound stops the run with TrainingDiverged naming the knob. The learner runs
    DeepSpeed ZeRO-2 on one rank, as a one-worker job does, on copies of the shared model (the engine
    hooks its parameters)."""
    from osvl.errors import TrainingDiverged
    from osvl.rl.learner import Learner, make_engine

    shared, batch = model_and_batch
    with torch.no_grad():
        logp, _ = forward_logprobs(shared, batch)
    b = dict(batch, old_logprobs=logp)
    cfg = RLConfig(beta=0.0, lr=1e-3)
    learner = Learner(make_engine(copy.deepcopy(shared), cfg), cfg)
    model = learner.model
    before = [p.detach().clone() for p in model.parameters()]
    res = learner.step([(dict(b, reward=torch.tensor([float("nan")] + [0.5] * 7)), True)])
    assert res.skipped and learner.skipped == 1 and learner.step_count == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    res = learner.step([(b, True)])
    assert not res.skipped and learner.step_count == 1 and res.entropy > 0
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    bounded = RLConfig(beta=0.0, lr=0.0, entropy_max=res.entropy / 2)
    with pytest.raises(TrainingDiverged, match="entropy_max"):
        Learner(make_engine(copy.deepcopy(shared), bounded), bounded).step([(b, True)])


def test_learner_scores_at_the_sampling_temperature(model_and_batch):
    """Rollouts sampled at T record log-probs of the tempered distribution; before any update the
    learner's ratio must be exactly 1 (no clipping), which holds only when it divides its logits
    by the same T. At T=1 against T=0.3 behaviour log-probs (the random tiny model is nearly uniform,
    so a low T makes the gap visible), a share of the tokens is clipped."""
    from osvl.rl.learner import Learner, make_engine

    shared, batch = model_and_batch
    with torch.no_grad():
        behaviour, _ = forward_logprobs(shared, batch, temperature=0.3)
    b = dict(batch, old_logprobs=behaviour)
    cfg = RLConfig(beta=0.0, lr=0.0)
    matched = Learner(make_engine(copy.deepcopy(shared), cfg), cfg, temperature=0.3).step([(b, True)])
    assert matched.clip_fraction == 0.0
    mismatched = Learner(make_engine(copy.deepcopy(shared), cfg), cfg).step([(b, True)])
    assert mismatched.clip_fraction > 0.05
