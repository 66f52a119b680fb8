"""The trajectory buffer: issues group slots to rollout actors, admits finished groups, hands steps to the learner.

Slots. The run is a sequence of *group slots* n = 0, 1, 2, ...; slot n belongs to
learner step ``n // groups_per_step`` and asks for G samples of the next question
of ``order`` (the data cursor: a seeded permutation per epoch over the RL
questions). A slot's group id is ``g<n>``; it is issued, then either consumed by
exactly one learner step or dropped with a logged reason, never both and never
twice (the ledger enforces it, and a late duplicate from a presumed-dead actor is
refused).

Flat groups (``resample_flat``). A group whose samples all have the same accuracy
(all wrong or all right) carries no answer signal: its advantages rank format and
query quality only. With ``resample_flat`` k > 0 such a group is thrown away and its
slot re-issued with the cursor's next question, up to k times; the k-th flat group
is trained as it is, so a step never waits for ever. This is DAPO's dynamic
sampling on the accuracy instead of the reward (the reward of a flat group still
varies with r_query); k = 0 (the default) trains every group, as the paper does.
Without resampling, slot n gets ``order[n]``.

Staleness, docs/design.md: a group trains step s only if the oldest policy
version among its turns is >= s - max_staleness. The buffer makes this hold by
construction instead of by dropping: a slot of step s is issued only once the
learner has published version >= s - max_staleness, and the actor must sync to at
least that version before generating (``Work.min_version``). A rollout actor that
runs ahead therefore *waits* in ``acquire``; with max_staleness 0 this is exactly
synchronous GRPO (rollouts of step s start after version s exists). A group that
still arrives too stale (it cannot with the rules above, but a bug or a manual
weight reload could cause it) is dropped with reason ``stale``.

Learner steps take the slots of their step as a set, in any completion order.
A step waits until each of its slots is ready or dropped, which is what keeps the
staleness bound exact without dropping: a slow group is waited for, not skipped.

Checkpointing: ``state()`` is a plain dict (cursor, ledger, ready groups, slots in
flight); ``from_state`` rebuilds the buffer with every slot that was in flight put
back for re-issue (the actors that held them are gone), so nothing is lost and no
slot runs twice into training.

The class is plain Python with asyncio; ``ray.remote(TrajectoryBuffer)`` makes it
an async actor (all methods run on one event loop, so no locks are needed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Work:
    """One group slot handed to a rollout actor."""

    slot: int
    group_id: str
    question_index: int
    step: int           # the learner step that will consume it
    min_version: int    # the actor must generate with weights of at least this version
    seed: int           # sampling seed of the group (sample i uses seed + i)
    attempt: int = 0    # how many times this slot was issued before (re-issue after a dead actor or a flat group)


@dataclass
class _Slot:
    work: Work
    state: str = "issued"          # issued | ready | consumed | dropped
    actor: str = ""
    reason: str = ""
    group: list[Any] = field(default_factory=list)
    staleness: int = 0
    resamples: int = 0             # flat groups thrown away (their re-issues are not deaths: max_attempts)


class TrajectoryBuffer:
    """Issue/admit/consume ledger of group slots with the staleness gate (see the module docstring)."""

    def __init__(self, n_questions: int, groups_per_step: int, total_steps: int, max_staleness: int = 1,
                 seed: int = 0, max_attempts: int = 3, resample_flat: int = 0) -> None:
        if n_questions < 1 or groups_per_step < 1 or resample_flat < 0:
            raise ValueError("the buffer needs >= 1 question, >= 1 group per step and resample_flat >= 0")
        self.n_questions, self.gps, self.total_steps = n_questions, groups_per_step, total_steps
        self.max_staleness, self.seed, self.max_attempts = max_staleness, seed, max_attempts
        self.resample_flat = resample_flat
        self.version = 0            # latest policy version the learner published
        self.next_slot = 0          # next never-issued slot
        self.slots: dict[int, _Slot] = {}
        self.reissue: deque[int] = deque()   # slots whose actor died or whose group was flat, issued first
        self.log: list[str] = []             # drops and re-issues, human-readable, checkpointed
        self.taken: dict[int, list[list[Any]]] = {}  # step -> groups (idempotent take for all learner ranks)
        self.aborted = ""          # set by abort(): the run cannot go on (no rollout actor can start)
        # Actors released as dead. A dead actor's acquire() can still be waiting here (submitted before it
        # died, parked on the staleness gate): once woken it must not take a slot nobody will ever fill.
        self.dead: set[str] = set()
        self._cond: asyncio.Condition | None = None

    # -- data cursor -------------------------------------------------------

    def question_of(self, position: int) -> int:
        """order[position]: epoch e is a permutation seeded by (seed, e), so the cursor is one integer."""
        epoch, i = divmod(position, self.n_questions)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_questions)
        return int(perm[i])

    @property
    def resampled(self) -> int:
        """Flat groups thrown away so far (the slots' counts: checkpointed with them)."""
        return sum(s.resamples for s in self.slots.values())

    @property
    def next_question(self) -> int:
        """The data cursor, a position in order: every issue of a new slot and every re-draw took one question."""
        return self.next_slot + self.resampled

    def _work(self, slot: int, question: int, attempt: int = 0) -> Work:
        step = slot // self.gps
        return Work(slot=slot, group_id=f"g{slot}", question_index=question, step=step,
                    min_version=max(0, step - self.max_staleness),
                    seed=int(np.random.default_rng([self.seed, slot, 7]).integers(2**31)), attempt=attempt)

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _issuable(self, slot: int) -> bool:
        return slot // self.gps <= self.version + self.max_staleness

    # -- rollout side --------------------------------------------------------

    async def acquire(self, actor: str, timeout: float | None = None) -> Work | None:
        """The next slot this actor should generate, waiting while it would run ahead of the staleness bound.

        Returns None when every slot of the run is issued (the actor may stop), or on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self.cond:
            while True:
                if self.aborted or actor in self.dead:
                    return None
                if self.reissue:
                    slot = self.reissue.popleft()
                    s = self.slots[slot]
                    s.work = self._work(slot, s.work.question_index, s.work.attempt + 1)
                    s.state, s.actor = "issued", actor
                    return s.work
                if self.next_slot >= self.total_steps * self.gps:
                    return None
                if self._issuable(self.next_slot):
                    w = self._work(self.next_slot, self.question_of(self.next_question))
                    self.slots[w.slot] = _Slot(work=w, actor=actor)
                    self.next_slot += 1
                    return w
                if not await self._wait(deadline):
                    return None

    async def _wait(self, deadline: float | None) -> bool:
        """Wait (holding ``self.cond``) for the next notify; False once ``deadline`` has passed."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        try:
            await asyncio.wait_for(self.cond.wait(), left)
        except TimeoutError:
            return False
        return True

    async def put(self, actor: str, slot: int, attempt: int, group: list[Any], error: str = "") -> str:
        """Admit a finished group; returns "ready" or the reason it was refused/dropped.

        ``group`` holds Trajectory records (anything with ``turns[*].policy_version`` and
        ``judge_status``); ``error`` reports a group whose episodes raised (dropped with it).
        """
        async with self.cond:
            s = self.slots.get(slot)
            if s is None or s.state != "issued" or s.actor != actor or s.work.attempt != attempt:
                self.log.append(f"refused g{slot} from {actor} attempt {attempt}: not in flight there (duplicate)")
                return "duplicate"
            versions = [t.policy_version for tr in group for t in tr.turns if t.policy_version >= 0]
            oldest = min(versions) if versions else s.work.min_version
            s.staleness = s.work.step - oldest
            if error:
                self._drop(s, f"episode_error: {error}")
            elif s.staleness > self.max_staleness:
                self._drop(s, f"stale: oldest turn version {oldest} for step {s.work.step}")
            elif failed := [tr for tr in group if getattr(tr, "judge_status", "ok") == "failed"]:
                why = next((e for e in getattr(failed[0], "events", []) if e.startswith("judge_failed:")), "")
                self._drop(s, f"judge_failed: {len(failed)} of {len(group)} samples could not be judged"
                              + (f" ({why.removeprefix('judge_failed:')[:200]})" if why else ""))
            elif not group:
                self._drop(s, "empty group")
            elif s.resamples < self.resample_flat and len({tr.r_acc for tr in group}) == 1:
                old = s.work.question_index
                # a new Work: the one the actor holds stays as it was
                s.work = dataclasses.replace(s.work, question_index=self.question_of(self.next_question))
                s.resamples += 1
                s.actor = ""
                self.reissue.append(slot)
                self.log.append(f"resample g{slot} ({s.resamples}/{self.resample_flat}): every sample's accuracy "
                                f"{group[0].r_acc:g} on question {old}, next question {s.work.question_index}")
                self.cond.notify_all()
                return "resampled"
            else:
                s.state, s.group = "ready", list(group)
            self.cond.notify_all()
            return s.state if s.state == "ready" else s.reason.split(":")[0]

    async def release_actor(self, actor: str, reason: str) -> list[int]:
        """A rollout actor died: its slots in flight go back for re-issue (or are dropped after max_attempts)."""
        async with self.cond:
            self.dead.add(actor)
            out = []
            for slot, s in sorted(self.slots.items()):
                if s.state == "issued" and s.actor == actor:
                    if s.work.attempt - s.resamples + 1 >= self.max_attempts:
                        self._drop(s, f"attempts: {self.max_attempts} actors died holding it ({reason})")
                    else:
                        s.actor = ""
                        self.reissue.append(slot)
                        self.log.append(f"reissue g{slot} (attempt {s.work.attempt + 1}): {reason}")
                        out.append(slot)
            self.cond.notify_all()
            return out

    def _drop(self, s: _Slot, reason: str) -> None:
        s.state, s.reason, s.group = "dropped", reason, []
        self.log.append(f"dropped g{s.work.slot}: {reason}")

    # -- learner side --------------------------------------------------------

    async def take(self, step: int, timeout: float | None = None) -> list[list[Any]] | None:
        """The ready groups of ``step`` (dropped slots left out), once all its slots are resolved.

        Idempotent per step so every learner rank gets the same groups, also the ranks that were already
        waiting when the first one took them (every rank waits for step 0). None on timeout.
        """
        lo, hi = step * self.gps, (step + 1) * self.gps
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self.cond:
            while step not in self.taken and not all(n in self.slots and self.slots[n].state in ("ready", "dropped")
                                                     for n in range(lo, hi)):
                if self.aborted:
                    raise RuntimeError(f"GRPO run aborted: {self.aborted}")
                if not await self._wait(deadline):
                    return None
            if step in self.taken:
                return self.taken[step]
            groups = []
            for n in range(lo, hi):
                s = self.slots[n]
                if s.state == "ready":
                    groups.append(s.group)
                    s.state, s.group = "consumed", []
            self.taken = {step: groups}  # only the current step is kept: memory stays bounded
            self.cond.notify_all()  # the other ranks waiting for this step get the same groups
            return groups

    async def abort(self, reason: str) -> None:
        """Stop the run: the learner's ``take`` raises with ``reason``, actors get no more work."""
        async with self.cond:
            self.aborted = reason
            self.log.append(f"aborted: {reason}")
            self.cond.notify_all()

    def begin_learner(self) -> int:
        """Called by the learner when it starts; returns how many times it started before.

        The first call keeps a snapshot of the buffer: a learner restarted before its first
        checkpoint rewinds to it, so no step's groups are trained twice.
        """
        self._learner_starts = getattr(self, "_learner_starts", 0) + 1
        if self._learner_starts == 1:
            self._initial = self.state()
        return self._learner_starts - 1

    async def rewind(self, st: dict[str, Any] | None) -> None:
        """Back to a checkpoint's state (or to the snapshot of the learner's first start)."""
        async with self.cond:
            self.load_state(st if st is not None else self._initial, self.total_steps)
            self.log.append("rewound for a restarted learner")
            self.cond.notify_all()

    async def advance(self, version: int) -> None:
        """The learner published ``version``: slots up to step version + max_staleness become issuable."""
        async with self.cond:
            self.version = max(self.version, version)
            self.cond.notify_all()

    # -- accounting and checkpoints -------------------------------------------

    def stats(self) -> dict[str, Any]:
        states = Counter(s.state for s in self.slots.values())
        stale = Counter(s.staleness for s in self.slots.values() if s.state in ("ready", "consumed"))
        return {"version": self.version, "issued_total": self.next_slot, "ready": states["ready"],
                "in_flight": states["issued"], "consumed": states["consumed"], "dropped": states["dropped"],
                "reissue_queue": len(self.reissue), "resampled": self.resampled,
                "staleness": dict(sorted(stale.items())),
                "dropped_by_reason": dict(Counter(s.reason.split(":")[0] for s in self.slots.values()
                                                  if s.state == "dropped"))}

    def ledger(self) -> dict[str, dict[str, Any]]:
        """Every issued group id with its state, owner, attempts and drop reason (the exactly-once audit)."""
        return {s.work.group_id: {"state": s.state, "actor": s.actor, "attempt": s.work.attempt,
                                  "resamples": s.resamples, "reason": s.reason, "step": s.work.step}
                for s in self.slots.values()}

    def events(self) -> list[str]:
        return list(self.log)

    def state(self) -> dict[str, Any]:
        """Everything needed to resume; slots in flight are recorded as such and re-issued by ``from_state``."""
        return {"n_questions": self.n_questions, "gps": self.gps, "total_steps": self.total_steps,
                "max_staleness": self.max_staleness, "seed": self.seed, "max_attempts": self.max_attempts,
                "resample_flat": self.resample_flat, "version": self.version, "next_slot": self.next_slot,
                "log": list(self.log),
                "slots": {n: {"work": s.work, "state": s.state, "actor": s.actor, "reason": s.reason,
                              "group": s.group, "staleness": s.staleness, "resamples": s.resamples}
                          for n, s in self.slots.items()}}

    @classmethod
    def from_state(cls, st: dict[str, Any], total_steps: int | None = None) -> TrajectoryBuffer:
        b = cls(st["n_questions"], st["gps"], st["total_steps"], st["max_staleness"], st["seed"], st["max_attempts"],
                st.get("resample_flat", 0))
        b.load_state(st, total_steps)
        return b

    def load_state(self, st: dict[str, Any], total_steps: int | None = None) -> None:
        """Replace this buffer's state with a checkpoint's (the launcher calls it on the fresh actor)."""
        for key in ("n_questions", "gps", "max_staleness", "seed"):
            mine = {"gps": self.gps}.get(key, getattr(self, key, None))
            if mine != st[key]:
                raise ValueError(f"checkpoint buffer has {key}={st[key]}, this run {mine}: resume needs the same")
        self.total_steps = total_steps or st["total_steps"]
        self.version, self.next_slot, self.log = st["version"], st["next_slot"], list(st["log"])
        self.slots, self.reissue, self.taken = {}, deque(), {}
        for n, d in sorted(st["slots"].items()):
            s = _Slot(work=d["work"], state=d["state"], actor=d["actor"], reason=d["reason"], group=d["group"],
                      staleness=d["staleness"], resamples=d.get("resamples", 0))
            self.slots[n] = s
            if s.state == "issued":
                s.actor = ""
                self.reissue.append(n)
                self.log.append(f"reissue g{n} (attempt {s.work.attempt + 1}): resumed from a checkpoint")
