"""Every exception osvl raises on purpose, in one module.

Callers catch ``OsvlError`` for "anything osvl refused to do" and the subclasses
for the cases they handle differently. Tool failures are *not* exceptions on the
wire (they are typed ``ToolResult`` values, see ``osvl.tools``); ``ToolCallError``
exists for code that prefers raising, and carries the same ``kind``.
"""

from __future__ import annotations

TOOL_ERROR_KINDS = ("invalid_call", "tool_error", "timeout", "unavailable")
"""The four failure kinds of docs/design.md; a failed agent step has exactly one."""


class OsvlError(Exception):
    """Base class of every error osvl raises deliberately."""


class ConfigError(OsvlError):
    """A config file or ``--key=value`` override is wrong (unknown key, bad type, bad value)."""


class StorageError(ConfigError):
    """A storage URI (``run.root`` and the like) cannot be used: unknown scheme, unreachable endpoint,
    missing or refused credentials, missing bucket. Raised at start, before anything is written."""


class DependencyMissingError(OsvlError):
    """An optional dependency is not installed; the message names the install command."""

    def __init__(self, package: str, install: str, why: str = "") -> None:
        self.package = package
        self.install = install
        msg = f"{package} is not installed; install it with: {install}"
        if why:
            msg += f" ({why})"
        super().__init__(msg)


class DataError(OsvlError):
    """Input data (a KG file, a dump, a trajectory record) is malformed."""


class ModelLoadError(OsvlError):
    """A checkpoint directory is missing, incomplete or of an unsupported architecture."""


class EngineError(OsvlError):
    """A generation engine failed or refused a request (engine crashed, prompt over its context,
    vision inputs that do not match the prompt's image pads, a weight update that misses tensors)."""


class EndpointUnavailable(OsvlError):
    """An OpenAI-compatible endpoint (teacher, judge) gave no usable answer after its retries.

    Callers turn it into an explicit state (a judged sample is marked ``judge_status="failed"``
    with its group; a teacher rollout is dropped and counted), never a silent zero."""


class WeightsMissingError(ModelLoadError):
    """A model weight file (e.g. the EDSR checkpoint) does not exist: never a silent pass-through."""


class ParseError(OsvlError):
    """An assistant turn does not follow the chat format.

    ``kind`` is one of ``PARSE_ERROR_KINDS`` so that callers (the agent loop, r_fmt,
    tests) branch on a value instead of on message text.
    """

    def __init__(self, kind: str, message: str) -> None:
        if kind not in PARSE_ERROR_KINDS:
            raise ValueError(f"unknown parse error kind {kind!r}")
        self.kind = kind
        self.message = message
        super().__init__(f"{kind}: {message}")


PARSE_ERROR_KINDS = (
    "missing_tag",  # no <tool_call> or <response>, or an unclosed / misordered tag
    "two_actions",  # more than one <tool_call>/<response> in one turn
    "trailing_text",  # text outside <think>, the action, and whitespace
    "no_json",  # <tool_call> body is not a JSON object with name/arguments
    "unknown_tool",  # JSON names a tool that the conversation did not offer
)


class ToolCallError(OsvlError):
    """A tool call failed; ``kind`` is one of ``TOOL_ERROR_KINDS``."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in TOOL_ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r}")
        self.kind = kind
        self.message = message
        super().__init__(f"{kind}: {message}")


class LimitExceededError(ToolCallError):
    """Input over a configured limit (pixels, bytes): an ``invalid_call`` the HTTP API maps to 413."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_call", message)


class FetchRefused(ToolCallError):
    """The web fetch's SSRF guard refused a URL (``tool_error``: the page exists, the tool will not go there)."""

    def __init__(self, message: str) -> None:
        super().__init__("tool_error", message)


class InvalidCall(OsvlError):
    """Raised by argument validators inside a tool; ``call_tool`` turns it into an ``invalid_call`` result.

    ``limit`` marks an input over a configured limit (pixels, bytes): HTTP 413 rather than 422.
    """

    def __init__(self, message: str, *, limit: bool = False) -> None:
        super().__init__(message)
        self.limit = limit


class TrainingDiverged(OsvlError):
    """RL training left its configured KL or entropy bounds; the message says which and what to do."""
