"""A chat engine for judge tests: answers from a script of replies, records every call (shared by
tests/test_judge.py and tests/test_reward.py)."""

from __future__ import annotations


class RecordingEngine:
    """``complete(messages, sampling)`` answering from a script of replies, then ``fallback`` (no verdict),
    recording the calls."""

    def __init__(self, replies, name: str | None = "judge-a", fallback: str = "I am not sure.") -> None:
        self.replies = list(replies)
        self.calls = []
        self.fallback = fallback
        if name is not None:
            self.name = name

    async def complete(self, messages, sampling):
        self.calls.append((messages, sampling))
        return self.replies.pop(0) if self.replies else self.fallback
