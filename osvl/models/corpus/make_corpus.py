"""Rebuild ``corpus.txt``, the text the tiny tokenizer is trained on (run once; the output is committed).

    .venv/bin/python osvl/models/corpus/make_corpus.py ../shared/data

Three parts, all deterministic: lead paragraphs of every 20th Wikispeedia article (Wikipedia for
Schools 2007), "title: description. first sentence" lines of every 8th Wikidata/Wikipedia summary,
and agent exchanges in the chat format of docs/design.md, so that JSON punctuation, tool names and
``img_k`` references get merges of their own. The format tags themselves need no training text: the
tokenizer adds them as single tokens. See ATTRIBUTION.md for sources and licences.
"""

from __future__ import annotations

import json
import random
import sys
import tarfile
from pathlib import Path

from osvl import chat as fmt

OUT = Path(__file__).with_name("corpus.txt")
ARTICLE_STRIDE = 20
ARTICLE_CHARS = 900
SUMMARY_STRIDE = 8
N_EXCHANGES = 60
PAST = {"crop": "Cropped", "sharpen": "Sharpened"}  # what an image tool says it did

TOOLS = [
    {"name": "crop", "description": "Crop a region of an image.", "parameters": {"type": "object", "properties": {
        "image": {"type": "string"}, "x": {"type": "integer"}, "y": {"type": "integer"},
        "width": {"type": "integer"}, "height": {"type": "integer"}},
        "required": ["image", "x", "y", "width", "height"]}},
    {"name": "ocr", "description": "Read the text in an image.", "parameters": {"type": "object", "properties": {
        "image": {"type": "string"}}, "required": ["image"]}},
    {"name": "sharpen", "description": "Sharpen a blurred image.", "parameters": {"type": "object", "properties": {
        "image": {"type": "string"}}, "required": ["image"]}},
    {"name": "text_search", "description": "Search the web for a text query.", "parameters": {"type": "object",
        "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "image_search", "description": "Find pages that show this image.", "parameters": {"type": "object",
        "properties": {"image": {"type": "string"}}, "required": ["image"]}},
]


def wikispeedia_paragraphs(tgz: Path) -> list[str]:
    """Title plus lead text of every ARTICLE_STRIDE-th article, the wrapped lines joined back."""
    out = []
    with tarfile.open(tgz) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith(".txt")), key=lambda m: m.name)
        for m in members[::ARTICLE_STRIDE]:
            lines = tar.extractfile(m).read().decode("utf-8", "replace").splitlines()
            # the first lines are "#copyright", the title and the "Schools Wikipedia Selection" banner
            body, para = [], []
            for line in lines[6:]:
                line = line.strip()
                if line:
                    para.append(line)
                elif para:
                    body.append(" ".join(para))
                    para = []
            text = "\n".join(p for p in body if len(p) > 80)[:ARTICLE_CHARS]
            if text:
                out.append(lines[2].strip() + "\n" + text.rsplit(" ", 1)[0])
    return out


def wikidata_lines(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    out = []
    for title in sorted(data)[::SUMMARY_STRIDE]:
        e = data[title]
        first = (e.get("extract") or "").split(". ")[0].strip()
        out.append(f"{title}: {e.get('description') or ''}. {first}.")
    return out


def exchange(rng: random.Random, facts: list[str]) -> str:
    """One episode in the verbatim shape of docs/design.md, with made-up (not true) content."""
    title, _, rest = rng.choice(facts).partition(": ")
    turns = [f"{fmt.IM_START}system\nYou have tools:\n{json.dumps(rng.sample(TOOLS, 3))}{fmt.IM_END}",
             f"{fmt.IM_START}user\n{fmt.IMAGE_TOKENS}img_1\nWhat is shown in the image, and {rest[:60]}?{fmt.IM_END}"]
    n_img = 1
    for _ in range(rng.randint(1, 3)):
        tool = rng.choice(TOOLS)["name"]
        img = f"img_{rng.randint(1, n_img)}"
        if tool == "crop":
            args = {"image": img, "x": rng.randint(0, 400), "y": rng.randint(0, 300),
                    "width": rng.randint(20, 300), "height": rng.randint(20, 300)}
        elif tool == "text_search":
            args = {"query": title}
        else:
            args = {"image": img}
        call = json.dumps({"name": tool, "arguments": args})
        turns.append(f"{fmt.IM_START}assistant\n{fmt.THINK_OPEN}I should use {tool} on {img} first."
                     f"{fmt.THINK_CLOSE}\n{fmt.TOOL_CALL_OPEN}{call}{fmt.TOOL_CALL_CLOSE}{fmt.IM_END}")
        body, new_image = f"1. {title} — {rest[:200]}", ""
        if rng.random() < 0.15:
            body = "Error (tool_error): the region is outside the image"
        elif tool in ("crop", "sharpen"):
            n_img += 1
            body = f"{PAST[tool]} {img} as img_{n_img}."
            new_image = f"\n{fmt.IMAGE_TOKENS}img_{n_img}"
        turns.append(f"{fmt.IM_START}user\n{fmt.TOOL_RESPONSE_OPEN}\n{body}\n{fmt.TOOL_RESPONSE_CLOSE}"
                     f"{new_image}{fmt.IM_END}")
    turns.append(f"{fmt.IM_START}assistant\n{fmt.THINK_OPEN}The answer is {title}.{fmt.THINK_CLOSE}\n"
                 f"{fmt.RESPONSE_OPEN}{title}{fmt.RESPONSE_CLOSE}{fmt.IM_END}")
    return "\n".join(turns)


def main(shared: Path) -> None:
    articles = wikispeedia_paragraphs(shared / "wikispeedia" / "plaintext_articles.tgz")
    facts = wikidata_lines(shared / "wikidata" / "summaries_en.json")
    rng = random.Random(0)
    exchanges = [exchange(rng, facts) for _ in range(N_EXCHANGES)]
    OUT.write_text("\n\n".join(articles + facts + exchanges) + "\n")
    print(f"{OUT}: {len(articles)} articles, {len(facts)} summaries, {len(exchanges)} exchanges, "
          f"{OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
