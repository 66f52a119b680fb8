"""The chat format contract (osvl/chat.py): rendering, the Jinja twin, parsing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from osvl import chat as F
from osvl.chat import (
    CHAT_TEMPLATE,
    IMAGE_TOKENS,
    SPECIAL_TOKENS,
    ParsedTurn,
    assistant_text,
    format_score,
    parse_turn,
    render,
    system_prompt,
    tool_call_text,
    tool_error_text,
)
from osvl.errors import PARSE_ERROR_KINDS, TOOL_ERROR_KINDS, DataError, ParseError

TOOLS = [
    {"type": "function", "function": {
        "name": "image_search", "description": "Reverse image search: pages showing this image.",
        "parameters": {"type": "object", "properties": {"image": {"type": "string"}}, "required": ["image"]}}},
    {"type": "function", "function": {
        "name": "crop", "description": "Crop a box of an image (its own pixels) into a new image.",
        "parameters": {"type": "object", "properties": {
            "image": {"type": "string"}, "x": {"type": "integer"}, "y": {"type": "integer"},
            "width": {"type": "integer"}, "height": {"type": "integer"}},
            "required": ["image", "x", "y", "width", "height"]}}},
]
NAMES = {"image_search", "crop", "text_search"}

# docs/design.md, "Chat format", verbatim (a test below checks this copy against the doc).
VERBATIM = """\
<|im_start|>system
…tool schemas…<|im_end|>
<|im_start|>user
⟨img⟩img_1
What year was the architect of the building in the image born?<|im_end|>
<|im_start|>assistant
<think>The photo may show a famous tower; identify it first.</think>
<tool_call>{"name": "image_search", "arguments": {"image": "img_1"}}</tool_call><|im_end|>
<|im_start|>user
<tool_response>
1. Eiffel Tower — wrought-iron lattice tower in Paris …
</tool_response><|im_end|>
<|im_start|>assistant
<think>…</think>
<tool_call>{"name": "crop", "arguments": {"image": "img_1", "x": 10, "y": 20, "width": 200, "height": 120}}</tool_call><|im_end|>
<|im_start|>user
<tool_response>
Cropped img_1 to 200x120 as img_2.
</tool_response>
⟨img⟩img_2<|im_end|>
<|im_start|>assistant
<think>…</think>
<response>1832</response><|im_end|>
"""  # noqa: E501

EXAMPLE = [
    {"role": "user", "content": "What year was the architect of the building in the image born?",
     "images": ["img_1"]},
    {"role": "assistant", "content": assistant_text(
        "The photo may show a famous tower; identify it first.",
        tool_call={"name": "image_search", "arguments": {"image": "img_1"}})},
    {"role": "tool", "content": "1. Eiffel Tower — wrought-iron lattice tower in Paris …"},
    {"role": "assistant", "content": assistant_text(
        "…", tool_call={"name": "crop", "arguments": {"image": "img_1", "x": 10, "y": 20, "width": 200,
                                                       "height": 120}})},
    {"role": "tool", "content": "Cropped img_1 to 200x120 as img_2.", "images": ["img_2"]},
    {"role": "assistant", "content": assistant_text("…", response="1832")},
]

# The system prompt is part of the data contract (token-exact records, SFT data): pinned here.
GOLDEN_SYSTEM = (
    "You are a multimodal deep-search agent. Answer the user's question about the image(s): reason step by step, "
    "inspect the images and search for facts with the tools, then answer.\n\n# Tools\n\n"
    "You may call one of these functions per turn; their JSON schemas:\n<tools>\n"
    '{"type": "function", "function": {"name": "crop", "description": "Zürich <box> {x}", "parameters": {}}}\n'
    "</tools>\n\n# Format\n\n"
    "Every turn of yours is <think>your reasoning</think> followed by exactly one of\n"
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
    "<response>your final answer</response>\n"
    "Images are named img_1, img_2, ... in order of appearance. Pass an image by its name "
    '(for example "image": "img_1") and give coordinates in that image\'s own pixels. '
    "A tool's result comes back inside <tool_response></tool_response>, followed by any new images; "
    "a failed call comes back as Error (<kind>): <message>."
)
GOLDEN_TOOLS = [{"type": "function", "function": {"name": "crop", "description": "Zürich <box> {x}",
                                                   "parameters": {}}}]


# ---------------------------------------------------------------------------
# rendering


def test_verbatim_example_renders_byte_exact():
    expected = VERBATIM.replace("…tool schemas…", system_prompt(TOOLS)).replace("⟨img⟩", IMAGE_TOKENS)
    assert render(EXAMPLE, TOOLS) == expected
    assert render(EXAMPLE, TOOLS, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"


def test_verbatim_copy_matches_the_design_doc():
    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    block = re.search(r"Verbatim shape of one exchange.*?```\n(.*?)```", text, re.S)
    assert block is not None
    assert block.group(1) == VERBATIM


def test_system_prompt_is_pinned():
    assert system_prompt(GOLDEN_TOOLS) == GOLDEN_SYSTEM
    assert system_prompt([]) == GOLDEN_SYSTEM.replace(json.dumps(GOLDEN_TOOLS[0], ensure_ascii=False) + "\n", "")


def test_system_message_and_tools():
    user = {"role": "user", "content": "hi"}
    sysmsg = {"role": "system", "content": "Be brief."}
    assert render([user]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert render([sysmsg, user]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert render([sysmsg, user], GOLDEN_TOOLS) == (
        f"<|im_start|>system\nBe brief.\n\n{GOLDEN_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert render([user], GOLDEN_TOOLS) == f"<|im_start|>system\n{GOLDEN_SYSTEM}<|im_end|>\n" + render([user])
    assert render([user], []) == render([user])  # no tools offered: no system turn
    assert render([], add_generation_prompt=True) == "<|im_start|>assistant\n"
    assert render([]) == ""


def test_images_user_first_tool_after():
    msgs = [{"role": "user", "content": "Q", "images": ["img_1", "img_2"]},
            {"role": "assistant", "content": "A"},
            {"role": "tool", "content": tool_error_text("timeout", "no answer in 30 s"), "images": ["img_3"]},
            {"role": "tool", "content": "two", "images": ["img_4", "img_5"]}]
    v = IMAGE_TOKENS
    assert render(msgs) == (
        f"<|im_start|>user\n{v}img_1\n{v}img_2\nQ<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\nError (timeout): no answer in 30 s\n</tool_response>\n{v}img_3<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\ntwo\n</tool_response>\n{v}img_4\n{v}img_5<|im_end|>\n")


ROLES = "('system', 'user', 'assistant', 'tool')"


@pytest.mark.parametrize("messages, message", [
    ("not a list", "messages must be a list of dicts, got str"),
    (["user: hi"], "message 0 is not a dict: 'user: hi'"),
    ([{"role": "robot", "content": "x"}], f"message 0: role must be one of {ROLES}, got 'robot'"),
    ([{"content": "x"}], f"message 0: role must be one of {ROLES}, got None"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "s"}],
     "message 1: a system message may only come first"),
    ([{"role": "user", "content": None}], "message 0: content must be a str, got NoneType"),
    ([{"role": "user", "content": ["a"]}], "message 0: content must be a str, got list"),
    ([{"role": "user", "content": "x", "images": "img_1"}],
     "message 0: images must be a list of image names, got 'img_1'"),
    ([{"role": "user", "content": "x", "images": [1]}], "message 0: images must be a list of image names, got [1]"),
    ([{"role": "assistant", "content": "x", "images": ["img_1"]}],
     "message 0: only user and tool messages carry images, not 'assistant'"),
    ([{"role": "system", "content": "x", "images": ["img_1"]}],
     "message 0: only user and tool messages carry images, not 'system'"),
    ([{"role": "user", "content": "x", "images": ["img_2"]}],
     "message 0: image 'img_2' should be named 'img_1' (images are numbered in order of appearance)"),
    ([{"role": "user", "content": "x", "images": ["img_1"]}, {"role": "tool", "content": "y", "images": ["img_1"]}],
     "message 1: image 'img_1' should be named 'img_2' (images are numbered in order of appearance)"),
])
def test_render_rejects_malformed_messages(messages, message):
    with pytest.raises(DataError) as info:
        render(messages)
    assert str(info.value) == message


def test_render_accepts_tuples_and_missing_images():
    msgs = ({"role": "user", "content": "x", "images": ("img_1",)}, {"role": "tool", "content": "y", "images": None})
    assert render(msgs) == f"<|im_start|>user\n{IMAGE_TOKENS}img_1\nx<|im_end|>\n" \
        "<|im_start|>user\n<tool_response>\ny\n</tool_response><|im_end|>\n"


@pytest.mark.parametrize("tools", ["crop", [["crop"]], [{"type": "function"}, "crop"], None])
def test_system_prompt_rejects_non_schemas(tools):
    with pytest.raises(DataError) as info:
        system_prompt(tools)
    assert str(info.value) == f"tools must be a list of JSON-schema dicts, got {tools!r}"


def test_system_prompt_accepts_tuple():
    assert system_prompt(tuple(GOLDEN_TOOLS)) == GOLDEN_SYSTEM


# ---------------------------------------------------------------------------
# builders


def test_builders():
    assert tool_call_text("crop", {"image": "img_1", "q": "é"}) == \
        '<tool_call>{"name": "crop", "arguments": {"image": "img_1", "q": "é"}}</tool_call>'
    assert assistant_text("t", response="r") == "<think>t</think>\n<response>r</response>"
    assert assistant_text("", tool_call={"name": "crop", "arguments": {}}) == \
        '<think></think>\n<tool_call>{"name": "crop", "arguments": {}}</tool_call>'
    for kind in TOOL_ERROR_KINDS:
        assert tool_error_text(kind, "m s g") == f"Error ({kind}): m s g"


@pytest.mark.parametrize("call, message", [
    (lambda: tool_call_text("", {}), "tool name must be a non-empty str, got ''"),
    (lambda: tool_call_text(3, {}), "tool name must be a non-empty str, got 3"),
    (lambda: tool_call_text("crop", []), "tool arguments must be a dict, got list"),
    (lambda: assistant_text("t"), "an assistant turn has exactly one action: pass tool_call or response"),
    (lambda: assistant_text("t", response="r", tool_call={"name": "crop", "arguments": {}}),
     "an assistant turn has exactly one action: pass tool_call or response"),
    (lambda: assistant_text("a</think>b", response="r"), "think must be a str without '</think>', got 'a</think>b'"),
    (lambda: assistant_text(None, response="r"), "think must be a str without '</think>', got None"),
    (lambda: assistant_text("t", response="a</response>"),
     "response must be a str without '</response>', got 'a</response>'"),
    (lambda: assistant_text("t", response=5), "response must be a str without '</response>', got 5"),
    (lambda: assistant_text("t", tool_call={"name": "crop"}),
     "tool_call must be {'name': ..., 'arguments': {...}}, got {'name': 'crop'}"),
    (lambda: assistant_text("t", tool_call={"name": "crop", "arguments": {}, "x": 1}),
     "tool_call must be {'name': ..., 'arguments': {...}}, got {'name': 'crop', 'arguments': {}, 'x': 1}"),
    (lambda: assistant_text("t", tool_call=("crop", {})),
     "tool_call must be {'name': ..., 'arguments': {...}}, got ('crop', {})"),
    (lambda: assistant_text("t", tool_call={"name": "crop", "arguments": 1}), "tool arguments must be a dict, got int"),
    (lambda: tool_error_text("oops", "m"),
     "tool error kind must be one of ('invalid_call', 'tool_error', 'timeout', 'unavailable'), got 'oops'"),
])
def test_builders_reject_bad_input(call, message):
    with pytest.raises(DataError) as info:
        call()
    assert str(info.value) == message


# ---------------------------------------------------------------------------
# parsing


def test_parse_the_example_turns():
    turns = [m["content"] for m in EXAMPLE if m["role"] == "assistant"]
    assert parse_turn(turns[0], NAMES) == ParsedTurn(
        think="The photo may show a famous tower; identify it first.", action="tool_call", name="image_search",
        arguments={"image": "img_1"})
    assert parse_turn(turns[2], NAMES) == ParsedTurn(think="…", action="response", response="1832")


def test_parse_tolerates_whitespace_and_im_end():
    text = '  \n<think> a b </think>  \n\n<tool_call>  {"name": "crop", "arguments": {"x": 1}} \n</tool_call>\n'
    got = parse_turn(text + "<|im_end|>\n", ["crop"])
    assert got == ParsedTurn(think=" a b ", action="tool_call", name="crop", arguments={"x": 1})
    assert parse_turn("<think></think><response> 7 </response> <|im_end|>", []) == \
        ParsedTurn(think="", action="response", response=" 7 ")
    assert parse_turn("<think>x</think><response></response>", ()).response == ""


def test_parse_think_and_response_may_mention_tags():
    text = '<think>I could <response>guess</response> or <tool_call>{}</tool_call></think>\n<response>4</response>'
    assert parse_turn(text, NAMES) == ParsedTurn(
        think="I could <response>guess</response> or <tool_call>{}</tool_call>", action="response", response="4")
    got = parse_turn('<think>t</think><tool_call>{"name": "crop", "arguments": {"q": "a</tool_call>}{"}}'
                     "</tool_call>", NAMES)
    assert got.arguments == {"q": "a</tool_call>}{"}


CRASHERS = {
    "missing_tag": [
        "", "   ", "hello", "<|im_end|>", "<response>4</response>", "<think>a", "<think>a</think>",
        "<think>a</think>\n<response>x", '<think>a</think><tool_call>{"name": "crop", "arguments": {}}',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}} more', "<think>a</think> plain answer",
        "<think>a</think></response>", "<think>a<think>b", "</think><response>4</response>",
        "<thinks>a</think><response>4</response>",
    ],
    "two_actions": [
        "<think>a</think><response>x</response><response>y</response>",
        '<think>a</think><response>x</response>\n<tool_call>{"name": "crop", "arguments": {}}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}}</tool_call> ok <response>y</response>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}}</tool_call><tool_call>',
        '<think>a</think><tool_call>{"name": "zoom", "arguments": {}}</tool_call><response>y</response>',
    ],
    "trailing_text": [
        "<think>a</think><response>x</response> thanks",
        "pre <think>a</think><response>x</response>",
        "<think>a</think> so <response>x</response>",
        '<think>a</think> so <tool_call>{"name": "crop", "arguments": {}}</tool_call>',
        "<think>a</think><response>x</response></think>",
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}}</tool_call>}',
        '<think>a</think><tool_call>{"name": "zoom", "arguments": {}}</tool_call>.',
        "<think>a</think><response>x</response><|im_end|><|im_end|>",
    ],
    "no_json": [
        "<think>a</think><tool_call>not json</tool_call>",
        "<think>a</think><tool_call></tool_call>",
        "<think>a</think><tool_call>",
        "<think>a</think><tool_call>[1]</tool_call>",
        '<think>a</think><tool_call>"crop"</tool_call>',
        '<think>a</think><tool_call>{"name": "crop"}</tool_call>',
        '<think>a</think><tool_call>{"arguments": {}}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": []}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": "x=1"}</tool_call>',
        '<think>a</think><tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}, "id": 1}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}} junk</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {}}}</tool_call>',
        '<think>a</think><tool_call>{"name": "crop", "arguments": {</tool_call>',
    ],
    "unknown_tool": [
        '<think>a</think><tool_call>{"name": "zoom", "arguments": {}}</tool_call>',
        '<think>a</think><tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<think>a</think><tool_call>{"name": "Crop", "arguments": {}}</tool_call>',
    ],
}


@pytest.mark.parametrize("kind, text", [(k, t) for k, texts in CRASHERS.items() for t in texts])
def test_each_parse_error_kind(kind, text):
    with pytest.raises(ParseError) as info:
        parse_turn(text, ["crop"])
    assert info.value.kind == kind, info.value
    assert format_score(text, ["crop"]) == 0.0


def test_every_kind_has_a_crasher():
    assert set(CRASHERS) == set(PARSE_ERROR_KINDS)


LONG = "y" * 100


@pytest.mark.parametrize("text, message", [
    ("x <think>a</think><think>b</think><response>y</response>", "text before <think>: 'x '"),
    (LONG + "<think>a</think><response>y</response>", f"text before <think>: {LONG[:80]!r}"),
    ("<think>a</think><response>y</response> and more ", "text after the action: 'and more'"),
    (f"<think>a</think><response>y</response>{LONG}", f"text after the action: {LONG[:80]!r}"),
    ("<think>a</think> so <response>y</response>", "text between </think> and the action: 'so <response>y</response>'"),
    (f"<think>a</think>{LONG}<response>y</response>", f"text between </think> and the action: {LONG[:80]!r}"),
    ("<think>a</think><response>y</response><response>z</response>",
     "a turn has exactly one <tool_call> or <response>"),
    ('<think>a</think><tool_call>{"name": "zoom", "arguments": {}}</tool_call>',
     "no tool named 'zoom'; offered: ['crop', 'ocr']"),
    ("<think>a</think><tool_call>{x}</tool_call>",
     "tool call body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('<think>a</think><tool_call>{"name": "crop"}</tool_call>', 'tool call must be {"name": ..., "arguments": {...}}'),
    ('<think>a</think><tool_call>{"name": 1, "arguments": {}}</tool_call>',
     "tool call name must be a string and arguments an object"),
    ('<think>a</think><tool_call>{"name": "crop", "arguments": {}}x</tool_call>',
     "text after the JSON inside <tool_call>"),
    ("<think>a", "<think> is never closed"),
    ("<think>a</think><response>b", "<response> is never closed"),
    ('<think>a</think><tool_call>{"name": "crop", "arguments": {}}', "<tool_call> is never closed"),
    ("<think>a</think>", "no <tool_call> or <response> after </think>"),
    ("a", "the turn does not start with <think>"),
    (b"<think>a</think><response>b</response>", "expected a str, got bytes"),
])
def test_parse_error_messages_say_what_is_wrong(text, message):
    with pytest.raises(ParseError) as info:
        parse_turn(text, {"ocr", "crop"})
    assert info.value.message == message
    assert str(info.value) == f"{info.value.kind}: {message}"


def test_tool_names_must_not_be_a_str():
    with pytest.raises(DataError) as info:
        parse_turn('<think>a</think><tool_call>{"name": "cr", "arguments": {}}</tool_call>', "crop")
    assert str(info.value) == "tool_names must be a collection of names, not the str 'crop'"


def test_format_score_of_good_turns():
    assert format_score(assistant_text("t", response="r"), []) == 1.0
    assert format_score(assistant_text("t", tool_call={"name": "crop", "arguments": {}}), ["crop"]) == 1.0
    assert format_score(assistant_text("t", tool_call={"name": "crop", "arguments": {}}), ["ocr"]) == 0.0


# ---------------------------------------------------------------------------
# properties

TRICKY = ["<", ">", "</tool_call", "</tool_call>", "<tool_call>", "<response>", "</think", "<think>", "{", "}",
          "{}", '"', "\\", "\\u00e9", "'", "é", "東京", "🙂", "\n", " ", "\t", "<|image_pad|>", "</tool_response>",
          "null", "[", "]", ",", ":"]
tricky_text = st.lists(st.sampled_from(TRICKY) | st.text(max_size=4), max_size=12).map("".join)
json_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(tricky_text, inner, max_size=3), max_leaves=8)
arguments = st.dictionaries(tricky_text, json_value, max_size=4)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assistant_of(rendered: str) -> str:
    """The assistant turn as an engine would produce it: from after the header to the end, <|im_end|> included."""
    head = "<|im_start|>assistant\n"
    return rendered[rendered.index(head) + len(head):]


@FAST
@given(think=tricky_text.filter(lambda s: "</think>" not in s), name=st.sampled_from(sorted(NAMES)), args=arguments)
def test_tool_call_round_trip(think, name, args):
    text = assistant_text(think, tool_call={"name": name, "arguments": args})
    rendered = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": text}])
    got = parse_turn(_assistant_of(rendered), NAMES)
    assert got == ParsedTurn(think=think, action="tool_call", name=name, arguments=args)
    assert format_score(text, NAMES) == 1.0


@FAST
@given(think=tricky_text.filter(lambda s: "</think>" not in s),
       response=tricky_text.filter(lambda s: "</response>" not in s))
def test_response_round_trip(think, response):
    text = assistant_text(think, response=response)
    rendered = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": text}])
    assert parse_turn(_assistant_of(rendered), []) == ParsedTurn(think=think, action="response", response=response)


TAGS = [*SPECIAL_TOKENS, '{"name": "crop", "arguments": {}}', '{"name": "zoom", "arguments": {"a": "</tool_call>"}}',
        "{", "}", '"', "[]", " ", "\n", "x", "{\"name\": 1}"]
tag_soup = st.lists(st.sampled_from(TAGS) | st.text(max_size=3), max_size=14).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.text() | tag_soup)
def test_garbage_only_raises_parse_error(text):
    try:
        got = parse_turn(text, ["crop"])
    except ParseError as e:
        assert e.kind in PARSE_ERROR_KINDS
        assert format_score(text, ["crop"]) == 0.0
        return
    assert format_score(text, ["crop"]) == 1.0
    # whatever parses is canonical: rebuilt with the builders, it parses to the same turn
    action = {"response": got.response} if got.action == "response" else \
        {"tool_call": {"name": got.name, "arguments": got.arguments}}
    assert parse_turn(assistant_text(got.think, **action), ["crop"]) == got


# ---------------------------------------------------------------------------
# CHAT_TEMPLATE through a real Hugging Face tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", *SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([render(EXAMPLE, TOOLS)] * 3, trainer=trainer)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=list(SPECIAL_TOKENS))


def test_template_matches_render_on_the_example(hf_tokenizer):
    for gen in (False, True):
        for tools in (TOOLS, None):
            assert hf_tokenizer.apply_chat_template(EXAMPLE, tools=tools, tokenize=False,
                                                    add_generation_prompt=gen) == render(EXAMPLE, tools, gen)


def test_special_tokens_are_single_tokens(hf_tokenizer):
    text = render(EXAMPLE, TOOLS)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    for token in SPECIAL_TOKENS:
        tid = hf_tokenizer.convert_tokens_to_ids(token)
        assert hf_tokenizer(token, add_special_tokens=False)["input_ids"] == [tid]
    assert ids.count(hf_tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 2  # one per image of the example
    assert hf_tokenizer.decode(ids) == text


@st.composite
def conversations(draw):
    """A random multi-turn episode: optional system, user with images, assistant/tool turns, tool errors."""
    n = 0

    def images(k: int) -> list[str]:
        nonlocal n
        names = [f"img_{n + i + 1}" for i in range(k)]
        n += k
        return names

    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(tricky_text)})
    msgs.append({"role": "user", "content": draw(tricky_text), "images": images(draw(st.integers(0, 2)))})
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            content = assistant_text(draw(tricky_text.filter(lambda s: "</think>" not in s)),
                                     tool_call={"name": "crop", "arguments": draw(arguments)})
        else:
            content = draw(tricky_text)  # malformed turns are rendered verbatim too
        msgs.append({"role": "assistant", "content": content})
        if draw(st.booleans()):
            text = tool_error_text(draw(st.sampled_from(TOOL_ERROR_KINDS)), draw(tricky_text))
        else:
            text = draw(tricky_text)
        msg = {"role": "tool", "content": text}
        k = draw(st.integers(0, 2))
        if k or draw(st.booleans()):
            msg["images"] = images(k)
        msgs.append(msg)
    tools = draw(st.sampled_from([None, [], TOOLS, TOOLS[:1], GOLDEN_TOOLS]))
    return msgs, tools, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversations())
def test_template_equals_render(hf_tokenizer, case):
    msgs, tools, gen = case
    got = hf_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert got == render(msgs, tools, add_generation_prompt=gen)


def test_format_module_is_light():
    code = ("import sys, osvl.chat\n"
            "print(','.join(m for m in ('ray', 'torch', 'transformers', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_constants():
    assert F.STOP_STRINGS == ("</tool_call>", "</response>")
    assert IMAGE_TOKENS == "<|vision_start|><|image_pad|><|vision_end|>"
    assert SPECIAL_TOKENS == ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                              "<response>", "</response>", "<tool_response>", "</tool_response>",
                              "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
