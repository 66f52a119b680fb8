"""The paper's fatal-step claim, tested where it should hold: a controlled four-mode experiment.

    .venv/bin/python bench/fatal_claim.py [--seeds=30] [--steps=150] [--workers=2] [--out=runs/bench/fatal_claim]

The claim (arXiv 2605.05185): when a trajectory dies in a cascade of failed tool calls, vanilla GRPO pushes
its whole sequence down, the good prefix included; masking the tokens from the cascade on and clamping a
fatal trajectory's advantage at 0 stops that, and learning is better for it. osvl's demo cannot test it (its
fatal cascades are the policy's own malformed turns, a few dozen a run, and 3 seeds). This bench can: a small
multi-hop search environment whose only learner is the policy below, trained by osvl's own pieces — the
reward (``osvl.agent.reward.score_trajectory`` on real ``Trajectory``/``Turn`` records), the fatal rule
(``osvl.agent.fatal.find_fatal``, ``mask_start``), the group advantages, the modes and the loss
(``osvl.rl.loss``: ``group_advantages``, ``stats_members``, ``apply_mode``, ``token_mask``, ``policy_loss``).

**Environment** (parameters fixed in ``ENV`` below before the reported run, printed with the results). A
question is H hops; each turn the agent makes one tool call: the right query for the current hop (grounded
in a path entity; the result names the next one: one hop of progress), one of ``W`` wrong queries (an
ungrounded guess: no progress, no failure) or a malformed call (does not parse: a failed step). After H
right queries the agent answers, correctly. Budget: H + ``SLACK`` tool turns; K = 3 consecutive failed
steps are fatal and end the episode (``stop_on_fatal``, as the loop does). Three regimes:

- ``exogenous``: with probability ``Q`` per episode a tool outage of ``BURST`` = K turns starts at a turn
  drawn uniformly from the budget, whatever the agent does (every call inside it fails ``unavailable``):
  the flaky web tools the paper masks for. A fatal trajectory's prefix is usually good.
- ``policy``: no outages; cascades are the policy's own malformed calls (sticky: after a failure a
  malformed call is likelier). Punishing them is informative.
- ``triggered``: a wrong query sets off, with probability ``P_TRIGGER``, an outage of ``BURST`` turns from
  the next turn (a rate limit after a junk query): the fatal cascade is caused by the prefix.

**Policy**: a softmax over the 2 + W actions per state (hop h, consecutive failures c in 0..K-1), tabular
logits, starting from ``INIT`` (a partly trained policy: right 40%, sticky malformed calls); each turn is
one token whose log-prob the loss sees. Learner: one on-policy update per batch of ``GROUPS`` groups of G
samples, Adam at ``LR``, ``seq_mean_token_mean`` aggregation, no KL (a tabular policy has no reference to
drift from). ``LR`` was chosen on development seeds (10_000 onward), never on the reported ones.

**Design**: every (regime, H, seed) runs the four modes (``vanilla``, ``hard_mask`` — the paper's, fatal
trajectories dropped from the group statistics and the loss —, ``fatal_mask``, ``fatal_mask_clamp``) on
common random numbers: the uniforms that pick actions, outages and triggers are drawn once per seed and
shared by the modes, so differences between modes are paired. Outcomes per run: success without outages
(the exact probability, by dynamic programming over states, every ``EVAL_EVERY`` updates; its mean over
the run = the area under the learning curve, ``auc``; and at the end, ``final``), the share of fatal
trajectories whose advantage after the mode is positive (``fatal_pos``), and the probability of the right
first action at the end (``p_right0``). Per regime and H: each mode's mean and the paired difference to
vanilla with a t-based 95% interval over seeds.

Last stdout line: JSON with ``ratio`` = fatal_mask_clamp / vanilla ``auc`` in the exogenous regime at H=4,
beside every figure; a PNG of the learning curves next to it. What it does and does not show: the
mechanism on a policy whose states are separate (no generalisation between them), not the size of any gain
on a language model.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from osvl.agent.fatal import NOT_FATAL, find_fatal, mask_start  # noqa: E402
from osvl.agent.reward import RewardConfig, score_trajectory  # noqa: E402
from osvl.agent.trajectory import Trajectory, Turn  # noqa: E402
from osvl.plots import curve_grid  # noqa: E402
from osvl.rl.loss import MODES, apply_mode, group_advantages, policy_loss, stats_members, token_mask  # noqa: E402
from osvl.rl.report import paired_interval  # noqa: E402

MODE_NAMES = ("vanilla", "hard_mask", "fatal_mask", "fatal_mask_clamp")
REGIMES = ("exogenous", "policy", "triggered")
HOPS = (2, 4)


@dataclass(frozen=True)
class Env:
    """The environment and learner, fixed before the reported run (module docstring)."""

    K: int = 3             # consecutive failed steps that are fatal
    W: int = 2             # wrong queries on offer
    SLACK: int = 3         # tool turns beyond the H needed
    Q: float = 0.3         # exogenous: episodes that meet an outage
    BURST: int = 3         # outage length in turns (= K: fatal for an agent that keeps calling)
    P_TRIGGER: float = 0.5 # triggered: chance a wrong query sets off an outage
    INIT_RIGHT: float = 0.4          # starting policy: P(right query) at every state
    INIT_MALFORMED: float = 0.15     # P(malformed) with no failure just before
    INIT_MALFORMED_STICKY: float = 0.5  # P(malformed) right after a failure
    G: int = 8
    GROUPS: int = 8
    LR: float = 0.01
    EVAL_EVERY: int = 10
    AGGREGATION: str = "seq_mean_token_mean"  # the paper's (docs/measurements.md's diagnostic: token_mean)


ENV = Env()
RIGHT, MALFORMED = 0, 1  # action ids; 2.. are the wrong queries
REWARD = RewardConfig()  # the default reward: r_fmt on the pre-fatal prefix, malformed arguments counted


def init_logits(H: int, env: Env) -> torch.Tensor:
    """(H, K, 2 + W) logits of the starting policy."""
    out = torch.zeros(H, env.K, 2 + env.W)
    for c in range(env.K):
        mal = env.INIT_MALFORMED if c == 0 else env.INIT_MALFORMED_STICKY
        right = min(env.INIT_RIGHT, 1.0 - mal - 0.05)
        probs = [right, mal] + [(1.0 - right - mal) / env.W] * env.W
        out[:, c] = torch.log(torch.tensor(probs))
    return out


def success_probability(probs: np.ndarray, H: int, env: Env) -> float:
    """Exact success probability without outages: dynamic programming over (hop, consecutive failures)."""
    turns = H + env.SLACK
    state = np.zeros((H + 1, env.K))
    state[0, 0] = 1.0
    done = 0.0
    for _ in range(turns):
        nxt = np.zeros_like(state)
        for h in range(H):
            for c in range(env.K):
                p = state[h, c]
                if p == 0:
                    continue
                pr = probs[h, c]
                if h + 1 == H:
                    done += p * pr[RIGHT]
                else:
                    nxt[h + 1, 0] += p * pr[RIGHT]
                nxt[h, 0] += p * pr[2:].sum()
                if c + 1 < env.K:
                    nxt[h, c + 1] += p * pr[MALFORMED]
        state = nxt
    return float(done)


@functools.cache
def question(H: int) -> dict[str, Any]:
    """The synthetic question's row: the path titles r_query's progress reads."""
    return {"id": f"h{H}", "question": f"Which entity is {H} hops from the pictured Entity0?",
            "answer": f"Entity{H}", "answer_aliases": [], "path": [{"title": f"Entity{h}"} for h in range(H + 1)]}


def _score(traj: Trajectory, row: dict[str, Any]) -> Trajectory:
    """``score_trajectory`` with the rule judge never suspends, so its coroutine runs to the end at once."""
    coro = score_trajectory(traj, row, REWARD)
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("score_trajectory suspended: the rule judge should not")


def episode(policy: np.ndarray, H: int, regime: str, env: Env, u_act: np.ndarray, u_trig: np.ndarray,
            outage_start: int) -> tuple[Trajectory, list[tuple[int, int, int]]]:
    """One episode on pre-drawn uniforms; returns the scored trajectory and its (h, c, action) per turn."""
    row = question(H)
    turns: list[Turn] = []
    taken: list[tuple[int, int, int]] = []
    h = c = 0
    down_until = -1
    down_from = outage_start if outage_start >= 0 else 10**9
    stop, final, fatal = "max_turns", None, None
    for t in range(H + env.SLACK):
        a = int(np.searchsorted(np.cumsum(policy[h, c]), u_act[t] * policy[h, c].sum(), side="right"))
        a = min(a, policy.shape[2] - 1)
        taken.append((h, c, a))
        down = down_from <= t < down_from + env.BURST or t <= down_until
        if a == MALFORMED:
            turn = Turn(t, "", "invalid", status="error", error_kind="invalid_call", failed=True,
                        observation="Error (invalid_call): missing_tag")
        else:
            query = f"Entity{h} relation" if a == RIGHT else f"guess {a - 1}"
            turn = Turn(t, "", "tool_call", tool="text_search", arguments={"query": query})
            if down:
                turn.status, turn.error_kind, turn.failed = "error", "unavailable", True
                turn.observation = "Error (unavailable): text_search: outage"
            else:
                turn.status = "ok"
                turn.observation = f"1. Entity{h + 1}: linked from Entity{h}" if a == RIGHT else "No results"
                if a == RIGHT:
                    h += 1
                elif regime == "triggered" and u_trig[t] < env.P_TRIGGER:
                    down_until = t + env.BURST
        turns.append(turn)
        c = c + 1 if turn.failed else 0
        if turn.failed:
            fatal = find_fatal([x.failed for x in turns], env.K)
            if fatal is not None:
                stop = "fatal"
                break
        if h == H:
            turns.append(Turn(t + 1, "", "response"))
            stop, final = "response", row["answer"]
            break
    traj = Trajectory(id="", question_id=row["id"], group_id="", kind="policy", question=row["question"],
                      answer=row["answer"], answer_aliases=[], input_ids=[], gen_mask=[], logprobs=[], step_ids=[],
                      images=[], image_max_pixels=[], processor={}, turns=turns,
                      fatal_cascade_start=fatal.cascade_start if fatal else -1,
                      fatal_kth=fatal.kth_failure if fatal else -1, stop_reason=stop, final_answer=final)
    return _score(traj, row), taken


def run(regime: str, H: int, seed: int, steps: int, env: Env = ENV) -> dict[str, Any]:
    """The four modes on one seed's common random numbers."""
    torch.set_num_threads(1)
    turns = H + env.SLACK
    B = env.G * env.GROUPS
    rng = np.random.default_rng([seed, H, REGIMES.index(regime)])
    u_act = rng.random((steps, B, turns))
    u_trig = rng.random((steps, B, turns))
    hit = rng.random((steps, B)) < (env.Q if regime == "exogenous" else 0.0)
    starts = np.where(hit, rng.integers(0, turns, (steps, B)), -1)
    group = torch.arange(B) // env.G
    out: dict[str, Any] = {}
    for mode in MODE_NAMES:
        logits = init_logits(H, env).requires_grad_(True)
        opt = torch.optim.Adam([logits], lr=env.LR)
        curve, fatal_n, fatal_pos, fatal_share = [], 0, 0, []
        for step in range(steps):
            probs = torch.softmax(logits.detach(), -1).numpy()
            if step % env.EVAL_EVERY == 0:
                curve.append(success_probability(probs, H, env))
            eps = [episode(probs, H, regime, env, u_act[step, i], u_trig[step, i], int(starts[step, i]))
                   for i in range(B)]
            reward = torch.tensor([tr.reward for tr, _ in eps])
            fatal = torch.tensor([tr.fatal for tr, _ in eps])
            raw = group_advantages(reward, group, member=stats_members(fatal, mode))
            adv, weight = apply_mode(raw, fatal, mode)
            hs = torch.zeros(B, turns, dtype=torch.long)
            cs = torch.zeros_like(hs)
            acts = torch.zeros_like(hs)
            gen = torch.zeros(B, turns)
            for i, (_, taken) in enumerate(eps):
                for t, (h, c, a) in enumerate(taken):
                    hs[i, t], cs[i, t], acts[i, t], gen[i, t] = h, c, a, 1.0
            start = torch.tensor([mask_start(tr.fatal_cascade_start, tr.fatal_kth, "cascade") for tr, _ in eps])
            if not MODES[mode].mask_post_fatal:
                start = torch.full_like(start, NOT_FATAL)
            mask = token_mask(gen, torch.arange(turns).expand(B, turns), start)
            logp = torch.log_softmax(logits[hs, cs], -1).gather(-1, acts.unsqueeze(-1)).squeeze(-1)
            loss = policy_loss(logp, logp.detach(), adv, mask, weight, gen_mask=gen, aggregation=env.AGGREGATION).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            n = int(fatal.sum())
            fatal_n += n
            fatal_pos += int(((adv * weight > 0) & fatal).sum())
            fatal_share.append(n / B)
        probs = torch.softmax(logits.detach(), -1).numpy()
        curve.append(success_probability(probs, H, env))
        out[mode] = {"auc": float(np.mean(curve)), "final": curve[-1], "curve": curve,
                     "fatal_pos": fatal_pos / fatal_n if fatal_n else float("nan"),
                     "fatal_share": float(np.mean(fatal_share)), "p_right0": float(probs[0, 0, RIGHT])}
    return {"regime": regime, "H": H, "seed": seed, "modes": out}


def _run(args: tuple[str, int, int, int]) -> dict[str, Any]:
    return run(*args)


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for regime in REGIMES:
        for H in HOPS:
            rows = [r for r in results if r["regime"] == regime and r["H"] == H]
            if not rows:
                continue
            cell: dict[str, Any] = {}
            for mode in MODE_NAMES:
                m = {k: float(np.nanmean([r["modes"][mode][k] for r in rows]))
                     for k in ("auc", "final", "fatal_pos", "fatal_share", "p_right0")}
                if mode != "vanilla":
                    for k in ("auc", "final", "p_right0"):
                        m[f"{k}_vs_vanilla"] = paired_interval([r["modes"][mode][k] for r in rows],
                                                      [r["modes"]["vanilla"][k] for r in rows])
                cell[mode] = m
            cell["order_auc"] = sorted(MODE_NAMES, key=lambda m: -cell[m]["auc"])
            table[f"{regime}_H{H}"] = cell
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--first_seed", type=int, default=0, help="10_000 and up: the development seeds")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--hops", default=",".join(map(str, HOPS)))
    ap.add_argument("--out", default="runs/bench/fatal_claim")
    a = ap.parse_args()
    tasks = [(regime, H, a.first_seed + s, a.steps) for regime in a.regimes.split(",")
             for H in map(int, a.hops.split(",")) for s in range(a.seeds)]
    t0 = time.time()
    print(f"fatal_claim: {len(tasks)} runs x {len(MODE_NAMES)} modes, {a.steps} updates each, env {asdict(ENV)}",
          flush=True)
    with mp.get_context("spawn").Pool(a.workers) as pool:
        results = []
        for i, r in enumerate(pool.imap_unordered(_run, tasks), 1):
            results.append(r)
            if i % 20 == 0 or i == len(tasks):
                print(f"  {i}/{len(tasks)} runs, {time.time() - t0:.0f} s", flush=True)
    table = summarise(results)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(results))

    panels = {key: {mode: [r["modes"][mode]["curve"] for r in results
                           if f"{r['regime']}_H{r['H']}" == key] for mode in MODE_NAMES} for key in table}
    png = curve_grid(panels, out / "fatal_claim.png", xlabel=f"update / {ENV.EVAL_EVERY}",
                     ylabel="P(success), no outages")
    for key, cell in table.items():
        line = ", ".join(f"{m} {cell[m]['auc']:.3f}" for m in cell["order_auc"])
        print(f"{key}: auc {line}")
    ex = table.get("exogenous_H4")
    ratio = ex["fatal_mask_clamp"]["auc"] / ex["vanilla"]["auc"] if ex else float("nan")
    print(json.dumps({"ratio": ratio, "metric": "fatal_mask_clamp / vanilla auc, exogenous outages, H=4",
                      "seeds": a.seeds, "first_seed": a.first_seed, "steps": a.steps, "env": asdict(ENV),
                      "seconds": round(time.time() - t0, 1), "png": str(png), "table": table}))


if __name__ == "__main__":
    main()
