"""One agent episode: generate a turn, parse it, run the tool, append the answer, repeat.

The same loop serves RL rollouts, teacher data, eval and ``jobs/ask.py``. With a token
engine it records a *policy* trajectory token for token: the ids the engine consumed and
produced, in the chat format of docs/design.md, with the behaviour log-probs. With a chat
engine (a teacher) it records a *teacher* trajectory: the same conversation, each assistant
text tokenized once with the student's tokenizer and processor, no log-probs.

How a turn ends. Generation stops on ``</tool_call>``, ``</response>``, ``<|im_end|>`` or
eos. The loop then appends, as template tokens (``gen_mask`` 0), ``<|im_end|>\\n`` (only
``\\n`` when the model itself ended with ``<|im_end|>``), the tool's answer as a user turn
and ``<|im_start|>assistant\\n``, so the next turn is generated from exactly the ids a
training forward will see. A turn that does not parse is a failed ``invalid_call`` step and
is answered with an error tool response, so the model sees its mistake and the episode goes
on (unless it is fatal).

Fatal steps (``osvl.agent.fatal``): after each failed step the loop looks for K consecutive
failed steps of the counted kinds; the first such run records ``fatal_cascade_start`` and
``fatal_kth`` (0-based turn indices) and, with ``stop_on_fatal`` (default, as the released
code), ends the episode right after the K-th failure.

Tool outages (``osvl.tools.outages``): when ``client`` is an ``OutageClient``, the episode's
seeded outage (if any) is recorded as an ``outage:...`` event, and each tool call inside its
window fails with the injected kind instead of reaching the tool: a failed step like any other.

Budgets: ``max_turns`` assistant turns, ``max_new_tokens`` per turn, ``max_episode_tokens``
for the whole sequence (a turn may generate at most what is left). Stop reasons: response,
max_turns, max_tokens (no room left to generate), fatal, context_overflow.

Overflow policy (``overflow``), for a tool answer that would not fit in
``max_episode_tokens`` with at least one token left to generate:
- ``downscale`` (default): the new images' ``max_pixels`` is quartered (each side halved)
  step by step, down to the processor's ``min_pixels``, until the answer fits; each change
  is recorded in ``events`` as ``overflow:img_k:max_pixels A->B``. If it still does not fit,
  the episode ends with ``context_overflow`` (event ``overflow:stop``).
- ``stop``: the episode ends with ``context_overflow`` at once.
The tool answer that did not fit is not appended; its ``Turn`` still records it. A text-only
answer that does not fit ends the episode with ``max_tokens``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import numpy as np

from osvl import chat as fmt
from osvl.agent.engines.base import ChatEngine, GenRequest, Sampling, TokenEngine
from osvl.agent.fatal import find_fatal
from osvl.agent.trajectory import Trajectory, TrajectoryBuilder, Turn, image_token_count
from osvl.config import opt
from osvl.errors import TOOL_ERROR_KINDS, ConfigError, ParseError
from osvl.tools.client import ToolClient
from osvl.tools.outages import OutageClient

Overflow = Literal["downscale", "stop"]
OVERFLOW_POLICIES = get_args(Overflow)
CLOSING_TOKENS = 2  # "<|im_end|>" "\n": kept free so every turn can be closed within max_episode_tokens


@dataclass
class AgentConfig:
    """Budgets and fatal-step rules of one episode; all recorded in ``Trajectory.budgets``."""

    max_turns: int = opt(8, "Assistant turns per episode.")
    max_new_tokens: int = opt(256, "Tokens one assistant turn may generate.")
    max_episode_tokens: int = opt(4096, "Tokens of the whole episode (prompt, images, tools, turns).")
    min_pixels: int | None = opt(None, "Image min_pixels; None = the processor's own (it must match the "
                                       "processor: the engine resizes with its own processor).")
    max_pixels: int | None = opt(None, "Image max_pixels for the question's and tools' images; None = the "
                                       "processor's own.")
    k: int = opt(3, "Consecutive failed steps that make a trajectory fatal (K).")
    fatal_kinds: list[str] = opt(list(TOOL_ERROR_KINDS), "Failure kinds that count toward K.")
    stop_on_fatal: bool = opt(True, "End the episode at the K-th consecutive failure (released code).")
    temperature: float = opt(0.7, "Sampling temperature; 0 = greedy. RL: 0.7 (the paper's configuration table), no "
                                  "top-p/top-k; the learner scores log-probs at the same temperature.")
    overflow: Overflow = opt("downscale", "When a tool answer would overflow max_episode_tokens: 'downscale' its "
                                     "images, else end with context_overflow; or 'stop' at once.")

    def check(self) -> None:
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.max_episode_tokens < 1 or self.k < 1:
            raise ConfigError("max_turns, max_new_tokens, max_episode_tokens and k must be >= 1")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        bad = sorted(set(self.fatal_kinds) - set(TOOL_ERROR_KINDS))
        if bad:
            raise ConfigError(f"fatal_kinds: unknown kinds {bad}; choose from {TOOL_ERROR_KINDS}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids a turn stops on: ``</tool_call>``, ``</response>``, ``<|im_end|>`` and eos."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (fmt.TOOL_CALL_CLOSE, fmt.RESPONSE_CLOSE, fmt.IM_END)]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def tool_turn_text(observation: str, image_names: list[str]) -> str:
    """A tool answer as the chat format renders it, followed by the next assistant header."""
    pics = "".join(f"\n{fmt.IMAGE_TOKENS}{name}" for name in image_names)
    return (f"{fmt.IM_START}user\n{fmt.TOOL_RESPONSE_OPEN}\n{observation}\n{fmt.TOOL_RESPONSE_CLOSE}{pics}"
            f"{fmt.IM_END}\n{fmt.IM_START}assistant\n")


def _fit_images(b: TrajectoryBuilder, text: str, new: list[np.ndarray], cfg: AgentConfig, min_pixels: int,
                names: list[str], events: list[str]) -> list[int] | None:
    """Per-image max_pixels under which ``text`` (with ``new`` images) fits, or None (overflow policy above).

    Fits means: at least one token left to generate, plus the turn's closing ``<|im_end|>\\n``.
    """
    base = len(b) + len(b.tokenize(text.replace(fmt.IMAGE_PAD, "")))
    caps = [b.default_max_pixels] * len(new)
    while True:
        need = base + sum(image_token_count(a, c, b.processor) for a, c in zip(new, caps, strict=True))
        if need + 1 + CLOSING_TOKENS <= cfg.max_episode_tokens:
            return caps
        if cfg.overflow == "stop" or not new or all(c <= min_pixels for c in caps):
            if new:
                events.append("overflow:stop")
            return None
        for i, c in enumerate(caps):
            lower = max(min_pixels, c // 4)
            if lower < c:
                events.append(f"overflow:{names[i]}:max_pixels {c}->{lower}")
                caps[i] = lower


def _episode_id(question_id: str, group_id: str, sample: int, seed: int) -> str:
    digest = hashlib.sha256(f"{question_id}\x1f{group_id}\x1f{sample}\x1f{seed}".encode()).hexdigest()[:12]
    return f"{question_id}-{sample}-{digest}"


async def run_episode(engine: TokenEngine | ChatEngine, question: Mapping[str, Any], images: list[np.ndarray],
                      client: ToolClient | OutageClient, cfg: AgentConfig, *, processor: Any, tools: list[dict],
                      seed: int = 0, group_id: str = "", sample: int = 0,
                      image_store: dict[str, np.ndarray] | None = None, system: str | None = None,
                      on_turn: Callable[[Turn], None] | None = None) -> Trajectory:
    """Run one episode of ``question`` (a synth row) on ``images`` and return its trajectory (rewards unset).

    ``image_store``, when given, receives content hash -> array of every image the episode
    used (the question's and the tools'), ready for ``write_trajectories``. ``system`` is an
    instruction put before the tool list (``render``'s rule); the evaluator's no-tools modes
    use it to ask for a direct answer. ``on_turn``, when given, is called with each turn as soon as it is
    complete (its tool answered), so a caller can report the episode as it happens (the agent service's
    stream).
    """
    cfg.check()
    chat = hasattr(engine, "chat")
    tok = getattr(processor, "tokenizer", processor)
    tool_names = [t["function"]["name"] for t in tools]
    b = TrajectoryBuilder(processor, default_max_pixels=cfg.max_pixels)
    min_pixels = int(b.settings["min_pixels"])
    if cfg.min_pixels is not None and cfg.min_pixels != min_pixels:
        raise ConfigError(f"min_pixels={cfg.min_pixels} differs from the processor's {min_pixels}: the engine "
                          "resizes with its own processor, so set it in the checkpoint's image-processor config")
    stops = stop_token_ids(tok)
    im_end = tok.convert_tokens_to_ids(fmt.IM_END)
    episode: dict[str, np.ndarray] = {}  # img_k -> array, what tools can reference
    events: list[str] = []
    turns: list[Turn] = []
    stop_reason = ""
    final_answer = None
    fatal = None
    outage = client.outage(seed, cfg.max_turns) if isinstance(client, OutageClient) else None
    if outage is not None:
        events.append(outage.event())

    names = [f"img_{i + 1}" for i in range(len(images))]
    head = [{"role": "system", "content": system}] if system is not None else []
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": fmt.system_prompt(tools) if system is None
         else f"{system}\n\n{fmt.system_prompt(tools)}" if tools else system},
        {"role": "user", "content": str(question["question"]), "images": names}]
    prompt = fmt.render(head + messages[1:], tools=tools, add_generation_prompt=True)
    caps = _fit_images(b, prompt, list(images), cfg, min_pixels, names, events)
    if caps is None:
        stop_reason = "context_overflow" if images else "max_tokens"
    else:
        for name, arr, cap in zip(names, images, caps, strict=True):
            b.add_image(arr, cap)
            episode[name] = arr
        b.add_text(prompt)

    for t in range(cfg.max_turns if caps is not None else 0):
        room = cfg.max_episode_tokens - len(b) - CLOSING_TOKENS
        if room <= 0:
            stop_reason = "max_tokens"
            break
        sampling = Sampling(temperature=cfg.temperature, max_new_tokens=min(cfg.max_new_tokens, room),
                            seed=seed * 100_003 + t, stop_token_ids=stops)
        if chat:
            text = (await engine.chat(messages, dict(episode), sampling)).strip()
            if text.endswith(fmt.IM_END):
                text = text[: -len(fmt.IM_END)].rstrip()
            b.add_model_text(text, t)
            closing = fmt.IM_END + "\n"
            version = -1
        else:
            res = await engine.generate(GenRequest(list(b.input_ids), list(b.images), list(b.image_max_pixels),
                                                   sampling))
            version = res.version  # the engine's, not engine.version after the await (a weight update may land)
            b.add_generated(res.token_ids, res.logprobs, t)
            text = tok.decode(res.token_ids, skip_special_tokens=False)
            closing = "\n" if res.token_ids and res.token_ids[-1] == im_end else fmt.IM_END + "\n"
        messages.append({"role": "assistant", "content": text})

        turn = Turn(index=t, text=text, action="invalid", policy_version=version)
        turns.append(turn)
        new_names: list[str] = []
        new_arrays: list[np.ndarray] = []
        try:
            parsed = fmt.parse_turn(text, tool_names)
        except ParseError as e:
            turn.status, turn.error_kind = "error", "invalid_call"
            turn.observation = fmt.tool_error_text("invalid_call", f"{e.kind}: {e.message}")
        else:
            if parsed.action == "response":
                turn.action, final_answer = "response", parsed.response
                b.add_text(closing)
                stop_reason = "response"
                if on_turn is not None:
                    on_turn(turn)
                break
            turn.action, turn.tool, turn.arguments = "tool_call", parsed.name, parsed.arguments
            first = f"img_{len(episode) + 1}"
            if outage is not None and outage.covers(t, parsed.name):
                result = outage.result(parsed.name)
            else:
                result = await client.call(parsed.name, parsed.arguments, dict(episode), new_image_name=first)
            turn.status = result.status
            turn.observation = result.text
            if not result.ok:
                turn.error_kind = result.error.kind
            else:
                # name tool images in order of appearance, whatever the tool called them
                for arr in result.images.values():
                    new_names.append(f"img_{len(episode) + len(new_names) + 1}")
                    new_arrays.append(arr)
        turn.failed = turn.status == "error" and turn.error_kind in cfg.fatal_kinds
        if on_turn is not None:
            on_turn(turn)

        if fatal is None and turn.failed:
            fatal = find_fatal([x.failed for x in turns], cfg.k)
            if fatal is not None and cfg.stop_on_fatal:
                b.add_text(closing)
                stop_reason = "fatal"
                break
        if t + 1 == cfg.max_turns:
            b.add_text(closing)
            stop_reason = "max_turns"
            break
        segment = closing + tool_turn_text(turn.observation, new_names)
        caps = _fit_images(b, segment, new_arrays, cfg, min_pixels, new_names, events)
        if caps is None:  # the tool answer does not fit: images that could not shrink enough, or text alone
            b.add_text(closing)
            stop_reason = "context_overflow" if new_arrays else "max_tokens"
            break
        for name, arr, cap in zip(new_names, new_arrays, caps, strict=True):
            b.add_image(arr, cap)
            episode[name] = arr
        turn.new_images = new_names
        b.add_text(segment)
        messages.append({"role": "tool", "content": turn.observation, "images": new_names})
    else:
        stop_reason = stop_reason or "max_turns"

    if image_store is not None:
        image_store.update(b.image_map())
    budgets = asdict(cfg)
    budgets["min_pixels"], budgets["max_pixels"] = min_pixels, b.default_max_pixels
    qid = str(question.get("id", ""))
    return b.build(
        kind="teacher" if chat else "policy",
        id=_episode_id(qid, group_id, sample, seed), question_id=qid, group_id=group_id,
        question=str(question["question"]), answer=str(question.get("answer", "")),
        answer_aliases=[str(a) for a in (question.get("answer_aliases") or [])],
        turns=turns, fatal_cascade_start=fatal.cascade_start if fatal else -1,
        fatal_kth=fatal.kth_failure if fatal else -1, stop_reason=stop_reason, events=events, budgets=budgets,
        final_answer=final_answer, model=str(getattr(engine, "name", None) or getattr(engine, "path", "")),
        seed=seed, temperature=cfg.temperature)
