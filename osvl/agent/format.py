"""The chat format of ARCHITECTURE.md: special tokens, rendering, parsing, format check.

This module is the single source of truth for how a conversation becomes text.
SFT, RL, eval and serving all render through ``render`` (or ``CHAT_TEMPLATE``, its
Jinja twin for Hugging Face processors and vLLM), and every assistant turn is read
back with ``parse_turn``. It imports nothing heavy so ``import osvl`` stays light.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Qwen3-VL vision tokens: one image renders as VISION_START IMAGE_PAD VISION_END and the
# processor later expands the single IMAGE_PAD to as many pads as the image has patches.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_TOKENS = VISION_START + IMAGE_PAD + VISION_END

SPECIAL_TOKENS = [
    IM_START, IM_END,
    THINK_OPEN, THINK_CLOSE,
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE,
    RESPONSE_OPEN, RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE,
    VISION_START, IMAGE_PAD, VISION_END,
]
"""Every string the tokenizer must keep as one token."""

STOP_STRINGS = (TOOL_CALL_CLOSE, RESPONSE_CLOSE)
"""Generation stops after either action closes; the loop then appends ``<|im_end|>``."""
