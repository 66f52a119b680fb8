"""The OpenSearch-VL release formats: export osvl data to them, import them as osvl data.

So users can train on the published Search-VL SFT and RL sets, and publish their own.

**ShareGPT SFT** (the LLaMA-Factory layout the release uses), one JSON object per line:

    {"conversations": [{"from": "human", "value": "<image>What is ...?"},
                       {"from": "gpt", "value": "<think>…</think>\\n<tool_call>{…}</tool_call>"},
                       {"from": "observation", "value": "Cropped img_1 … as img_2.<image>"},
                       {"from": "gpt", "value": "<think>…</think>\\n<response>…</response>"}],
     "images": ["images/<sha>.png", ...], "system": "", "tools": "[{…json schema…}, …]"}

Each ``<image>`` stands for the next entry of ``images`` in order of appearance, so an
observation carries the images its tool returned. ``tools`` is a JSON *string* (as
LLaMA-Factory reads it). osvl adds ``id``, ``question_id``, ``answer`` and
``answer_aliases`` (ignored by other readers) so a round trip loses nothing.

Import renders a conversation once with the *student's* tokenizer and processor into an
``imported`` trajectory (no log-probs), by the same steps the agent loop uses for teacher
turns, so an exported teacher record comes back token for token. Assistant turns keep
their text verbatim whether or not they parse (a turn that does not is recorded as
``invalid``); ``tools`` non-empty renders osvl's system prompt from those schemas, with the
record's ``system`` text before it.

**RL JSONL**: ``{"id", "question", "answer", "images"}`` per line (images as paths relative
to the file). Import gives synthesize-shaped rows (``answer_aliases`` empty, no ``path``,
not degraded) with absolute image paths.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from osvl import chat as fmt
from osvl.agent.trajectory import Trajectory, TrajectoryBuilder, Turn, image_hash
from osvl.errors import DataError, ParseError
from osvl.storage import atomic

IMAGE_TAG = "<image>"
_ERROR = re.compile(r"^Error \((\w+)\): ")


def _copy_image(src: Path, out_dir: Path) -> str:
    rel = f"images/{src.name}"
    target = out_dir / rel
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    return rel


def _write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    with atomic(path) as tmp, tmp.open("w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file, or a JSON list (LLaMA-Factory accepts both)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# ShareGPT SFT


def to_sharegpt(traj: Trajectory, image_paths: Sequence[str], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One trajectory as a ShareGPT record; ``image_paths[i]`` is where image ``traj.images[i]`` lives."""
    n_user = len(traj.images) - sum(len(t.new_images) for t in traj.turns)
    conv = [{"from": "human", "value": IMAGE_TAG * n_user + traj.question}]
    for k, t in enumerate(traj.turns):
        conv.append({"from": "gpt", "value": t.text})
        # the loop renders a tool answer only when another turn follows (not at max_turns or the fatal stop)
        if t.action != "response" and k + 1 < len(traj.turns):
            conv.append({"from": "observation", "value": t.observation + IMAGE_TAG * len(t.new_images)})
    return {"conversations": conv, "images": list(image_paths), "system": "",
            "tools": json.dumps(tools, ensure_ascii=False), "id": traj.id, "question_id": traj.question_id,
            "answer": traj.answer, "answer_aliases": list(traj.answer_aliases)}


def export_sharegpt(trajs: Sequence[Trajectory], image_dir: str | Path, out_dir: str | Path,
                    tools: list[dict[str, Any]], name: str = "sharegpt.jsonl") -> Path:
    """Write ``out_dir/<name>`` and copy each image once into ``out_dir/images/``."""
    out_dir, image_dir = Path(out_dir), Path(image_dir)
    records = []
    for t in trajs:
        paths = [_copy_image(image_dir / f"{sha}.png", out_dir) for sha in t.images]
        records.append(to_sharegpt(t, paths, tools))
    return _write_jsonl(out_dir / name, records)


def _strip_images(value: str) -> tuple[str, int]:
    """Text without its ``<image>`` tags (and the newline after a leading one), and how many there were."""
    n = value.count(IMAGE_TAG)
    return re.sub(re.escape(IMAGE_TAG) + r"\n?", "", value), n


def from_sharegpt(record: Mapping[str, Any], processor: Any, images: Sequence[np.ndarray], *,
                  max_pixels: int | None = None, model: str = "imported") -> Trajectory:
    """Render one ShareGPT record as an ``imported`` trajectory (see the module docstring)."""
    conv = list(record.get("conversations") or [])
    if not conv or conv[0].get("from") != "human":
        raise DataError(f"record {record.get('id', '?')}: conversations must start with a human turn")
    tools = record.get("tools") or []
    tools = json.loads(tools) if isinstance(tools, str) else list(tools)
    tool_names = [t["function"]["name"] for t in tools if "function" in t]
    question, n_user = _strip_images(conv[0]["value"])
    if sum(c.get("value", "").count(IMAGE_TAG) for c in conv) != len(images):
        raise DataError(f"record {record.get('id', '?')}: {len(images)} images for the <image> tags of the text")
    b = TrajectoryBuilder(processor, default_max_pixels=max_pixels)
    names = [f"img_{i + 1}" for i in range(n_user)]
    for arr in images[:n_user]:
        b.add_image(arr)
    messages: list[dict[str, Any]] = []
    if record.get("system"):
        messages.append({"role": "system", "content": record["system"]})
    messages.append({"role": "user", "content": question, "images": names})
    b.add_text(fmt.render(messages, tools=tools, add_generation_prompt=True))
    used, turns, closing = n_user, [], fmt.IM_END + "\n"
    final, stop = None, "max_turns"
    i = 1
    while i < len(conv):
        c = conv[i]
        if c.get("from") != "gpt":
            raise DataError(f"record {record.get('id', '?')}: turn {i} is {c.get('from')!r}, expected gpt")
        text = c["value"]
        t = len(turns)
        b.add_model_text(text, t)
        turn = Turn(index=t, text=text, action="invalid")
        turns.append(turn)
        try:
            parsed = fmt.parse_turn(text, tool_names)
            turn.action = parsed.action
            turn.tool, turn.arguments = parsed.name, parsed.arguments
            if parsed.action == "response":
                final, stop = parsed.response, "response"
        except ParseError:
            pass
        obs = conv[i + 1] if i + 1 < len(conv) and conv[i + 1].get("from") == "observation" else None
        if obs is not None and i + 2 >= len(conv):  # a last tool answer no turn read: recorded, not rendered
            turn.observation = _strip_images(obs["value"])[0]
            conv = conv[:i + 1]
            obs = None
        if obs is None:
            b.add_text(closing)
            i += 1
            if turn.action != "response" and i < len(conv):
                raise DataError(f"record {record.get('id', '?')}: a gpt turn follows a gpt turn")
            continue
        observation, n_new = _strip_images(obs["value"])
        new_names = [f"img_{used + k + 1}" for k in range(n_new)]
        for arr in images[used:used + n_new]:
            b.add_image(arr)
        used += n_new
        m = _ERROR.match(observation)
        turn.status = "error" if m or turn.action == "invalid" else "ok"
        turn.error_kind = (m.group(1) if m else "invalid_call") if turn.status == "error" else None
        turn.failed = turn.status == "error"
        turn.observation, turn.new_images = observation, new_names
        pics = "".join(f"\n{fmt.IMAGE_TOKENS}{n}" for n in new_names)
        b.add_text(f"{closing}{fmt.IM_START}user\n{fmt.TOOL_RESPONSE_OPEN}\n{observation}\n"
                   f"{fmt.TOOL_RESPONSE_CLOSE}{pics}{fmt.IM_END}\n{fmt.IM_START}assistant\n")
        i += 2
    rid = str(record.get("id") or "")
    return b.build(kind="imported", id=rid, question_id=str(record.get("question_id") or rid), group_id="",
                   question=question, answer=str(record.get("answer") or ""),
                   answer_aliases=[str(a) for a in record.get("answer_aliases") or []], turns=turns,
                   stop_reason=stop, final_answer=final, model=model, temperature=0.0)


def import_sharegpt(path: str | Path, processor: Any, *, max_pixels: int | None = None,
                    model: str = "imported") -> tuple[list[Trajectory], dict[str, np.ndarray]]:
    """Every record of a ShareGPT file as trajectories, and their images by hash (for ``write_trajectories``)."""
    path = Path(path)
    trajs, store = [], {}
    for k, record in enumerate(read_records(path)):
        arrays = []
        for p in record.get("images") or []:
            with Image.open(path.parent / p) as img:
                arrays.append(np.asarray(img.convert("RGB")))
        record = {**record, "id": record.get("id") or f"{path.stem}-{k}"}
        traj = from_sharegpt(record, processor, arrays, max_pixels=max_pixels, model=model)
        for arr in arrays:
            store.setdefault(image_hash(arr), arr)
        trajs.append(traj)
    return trajs, store


# ---------------------------------------------------------------------------
# RL JSONL


def export_rl(rows: Iterable[Mapping[str, Any]], image_dir: str | Path, out_dir: str | Path,
              name: str = "rl.jsonl") -> Path:
    """Synthesize rows -> ``out_dir/<name>`` (id, question, answer, images) with the images copied."""
    out_dir, image_dir = Path(out_dir), Path(image_dir)
    records = [{"id": r["id"], "question": r["question"], "answer": r["answer"],
                "images": [_copy_image(image_dir / n, out_dir) for n in r["images"]]} for r in rows]
    return _write_jsonl(out_dir / name, records)


def import_rl(path: str | Path) -> list[dict[str, Any]]:
    """An RL JSONL file as synthesize-shaped rows, images as absolute paths."""
    path = Path(path)
    rows = []
    for k, r in enumerate(read_records(path)):
        if "question" not in r or "answer" not in r:
            raise DataError(f"{path}: record {k} lacks question or answer")
        images = [str((path.parent / p).resolve()) for p in r.get("images") or []]
        for p in images:
            if not Path(p).is_file():
                raise DataError(f"{path}: record {k} names a missing image {p}")
        rows.append({"id": str(r.get("id") or f"{path.stem}-{k}"), "question": str(r["question"]),
                     "answer": str(r["answer"]), "answer_aliases": [], "images": images, "path": [],
                     "degraded": False, "degradation": ""})
    return rows

