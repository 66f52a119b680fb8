"""One GRPO learner step in micro-batches of a token budget, rows packed by length, vs one padded batch.

The step the demo trains at 8 groups of G=4: 32 trajectories whose lengths spread over
1,600-3,200 tokens (what the demo policy's episodes measure: a system prompt, the question, five
turns, tool answers). In one batch every row is padded to the step's longest and every activation
of the 32 rows is alive at once; ``rl.micro_tokens`` packs rows (groups in order of their longest
row, a group's rows shortest first) into micro-batches of that many tokens and accumulates their
gradients (``osvl.rl.learner_loop.rank_share``,
``Learner.step``). Both run the real learner: a one-rank DeepSpeed ZeRO-2 engine on the committed
demo policy (``osvl/models/weights/tiny_policy``), from the same weights, on the same rows, with
SGD, so the two updates must agree (``max_update_diff``, float32 summation order only).

Rows are text (random ordinary tokens, the generated/context pattern of an agent episode): the
vision tower's cost is the same in both and small at the demo's image sizes.

    .venv/bin/python bench/learner.py [--groups=8] [--group_size=4] [--micro_tokens=16384] [--repeats=2]

Last stdout line: JSON with each variant's CPU-seconds per step (best of ``--repeats``) and
``ratio`` = one padded batch's over the micro-batches'.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from osvl.agent.trajectory import Trajectory  # noqa: E402
from osvl.config import script_flags  # noqa: E402
from osvl.models.load import load_model, load_processor  # noqa: E402
from osvl.models.pretrain import FIRST_ORDINARY  # noqa: E402
from osvl.rl.learner import Learner, RLConfig, forward_logprobs, make_engine  # noqa: E402
from osvl.rl.learner_loop import rank_share, rl_batch  # noqa: E402

POLICY = Path(__file__).resolve().parents[1] / "osvl" / "models" / "weights" / "tiny_policy"


def episode(rng: random.Random, gid: int, i: int, length: int, reward: float, prompt: int = 300, turn_len: int = 60,
            tool: int = 240):
    """A policy record of about ``length`` random ordinary tokens: a ``prompt``-token prompt, then turns of
    ``turn_len`` generated tokens each followed by a ``tool``-token tool answer (by default the demo
    episodes' shape, not their text)."""
    ids, gen, step = [rng.randrange(FIRST_ORDINARY, 3900) for _ in range(prompt)], [0] * prompt, [-1] * prompt
    turn = 0
    while len(ids) < length:
        ids += [rng.randrange(FIRST_ORDINARY, 3900) for _ in range(turn_len + tool)]
        gen += [1] * turn_len + [0] * tool
        step += [turn] * turn_len + [-1] * tool
        turn += 1
    return Trajectory(id=f"g{gid}-{i}", question_id=f"q{gid}", group_id=f"g{gid}", kind="policy", question="",
                      answer="", answer_aliases=[], input_ids=ids, gen_mask=gen, logprobs=[0.0] * len(ids),
                      step_ids=step, images=[], image_max_pixels=[], processor={}, turns=[],
                      fatal_cascade_start=-1, fatal_kth=-1, reward=reward)


def main() -> None:
    flag, _ = script_flags(sys.argv[1:], {"groups": 8, "group_size": 4, "micro_tokens": 16384, "repeats": 2})
    n_groups, size, micro, repeats = flag["groups"], flag["group_size"], flag["micro_tokens"], flag["repeats"]
    torch.set_num_threads(2)
    rng = random.Random(0)
    groups = []
    for gid in range(n_groups):
        base = rng.randrange(1600, 2900)
        groups.append([episode(rng, gid, i, base + rng.randrange(0, 300), float(rng.random() < 0.3))
                       for i in range(size)])
    processor = load_processor(POLICY)
    init = load_model(POLICY, dtype="float32").eval()
    with torch.no_grad():  # behaviour log-probs of the starting weights: every ratio starts at 1
        for g in groups:
            for tr in g:
                tr.logprobs = forward_logprobs(init, rl_batch([[tr]], "", processor, RLConfig()))[0][0].tolist()

    def run(micro_tokens: int) -> tuple[float, dict[str, torch.Tensor]]:
        cfg = RLConfig(beta=0.0, lr=1.0, grad_clip=0.0, aggregation="token_mean", micro_tokens=micro_tokens)
        best, delta = float("inf"), {}
        for _ in range(repeats):
            model = load_model(POLICY, dtype="float32")
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            learner = Learner(make_engine(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=1.0)), cfg)
            share = rank_share(groups, 0, 1, cfg)
            res = learner.step([(rl_batch(chunk, "", processor, cfg), live) for chunk, live in share])
            best = min(best, res.cpu_s)
            delta = {k: v.detach() - before[k] for k, v in model.named_parameters()}
        print(f"  micro_tokens={micro_tokens}: {len(share)} micro-batch(es), {best:.1f} CPU-s per step", flush=True)
        return best, delta

    t0 = time.perf_counter()
    padded_s, want = run(0)
    micro_s, got = run(micro)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    rows = [len(tr.input_ids) for g in groups for tr in g]
    print(json.dumps({"ratio": round(padded_s / micro_s, 3), "padded_cpu_s": round(padded_s, 2),
                      "micro_cpu_s": round(micro_s, 2), "micro_tokens": micro, "groups": n_groups, "group_size": size,
                      "tokens": sum(rows), "padded_tokens": max(rows) * len(rows), "max_update_diff": diff,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
