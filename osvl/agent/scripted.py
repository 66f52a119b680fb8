"""A scripted teacher and the tiny *agent* checkpoint trained on its trajectories.

The tiny model of ``osvl.models.tiny`` has random weights, so it almost never writes a
turn that parses; code that must see a policy actually calling tools (the re-score test,
``bench/rollout.py``, the ``jobs/ask.py`` example) needs a model that does. This module
makes one honestly, without forced decoding:

1. ``ScriptedTeacher`` is a ``ChatEngine`` that answers each question with a fixed list of
   assistant turns. It goes through the real agent loop and the real tools, so its output
   is a genuine teacher record (rendered once with the student's tokenizer and processor).
2. ``tiny_agent_checkpoint()`` records the teacher on a few synthetic pictures and
   questions (crop -> a new image, text_search, response), fine-tunes the tiny Qwen3-VL on
   the model tokens (``gen_mask``) with a plain AdamW loop, and saves an ordinary
   checkpoint directory, cached under ``$OSVL_CACHE`` keyed by a hash of this file and the
   base model, so it is built once per machine.

Sampled at temperature 1.0 the result mostly calls crop, then text_search, then answers:
multi-turn episodes with a tool-returned image, of different lengths per question.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from osvl import chat as fmt
from osvl.agent.engines.base import Sampling
from osvl.agent.env import build_env
from osvl.agent.loop import AgentConfig, run_episode
from osvl.agent.trajectory import mm_token_type_ids, processor_inputs
from osvl.models.tiny import build_key as tiny_key
from osvl.models.tiny import build_once, tiny_checkpoint
from osvl.storage import cache_root
from osvl.tools.base import Tool
from osvl.tools.registry import all_tools

AGENT_TOOLS = ("crop", "text_search")
# (question, answer, text_search query). The thoughts are the same for every question so that a
# few hundred steps teach the format; queries and answers differ in length, so sampled episodes do.
PLANS = [
    ("Which tower is shown in the image?", "Eiffel Tower", "Eiffel Tower"),
    ("What amphitheatre does the picture show?", "Colosseum", "Colosseum amphitheatre in Rome"),
    ("Who designed the building in the photo?", "Gustave Eiffel", "architect of the Eiffel Tower in Paris"),
    ("In which city is the monument in the image?", "Paris", "city of the Eiffel Tower"),
    ("Which river flows past the city in the photo?", "Seine", "river of Paris"),
    ("What is the name of the statue in the picture?", "Statue of Liberty", "Statue of Liberty in New York"),
]
THOUGHTS = ("Crop the image to look closer.", "Search for it.", "The search result names it.")
CROP = {"x": 0, "y": 0, "width": 64, "height": 48}
PICTURE_SHAPE = (96, 128, 3)
SEED = 0
TRAIN_STEPS = 200
LR = 8e-3


class ScriptedTeacher:
    """``ChatEngine`` that plays fixed assistant turns per question, in order.

    ``plans`` maps a question's text to its assistant turns; the n-th call for a
    conversation returns the turn after the n assistant turns already in ``messages``.
    Tests use it for deterministic episodes (fatal-step rules, teacher records).
    """

    name = "scripted"

    def __init__(self, plans: Mapping[str, list[str]]) -> None:
        self.plans = dict(plans)

    async def chat(self, messages: list[dict], images: Mapping[str, np.ndarray], sampling: Sampling) -> str:
        question = next(m["content"] for m in messages if m["role"] == "user")
        done = sum(1 for m in messages if m["role"] == "assistant")
        turns = self.plans[question]
        return turns[min(done, len(turns) - 1)]


def agent_plans() -> dict[str, list[str]]:
    """The fine-tuning script: crop img_1, text_search, respond; per question of ``PLANS``."""
    plans = {}
    t0, t1, t2 = THOUGHTS
    for question, answer, query in PLANS:
        plans[question] = [
            fmt.assistant_text(t0, tool_call={"name": "crop", "arguments": {"image": "img_1", **CROP}}),
            fmt.assistant_text(t1, tool_call={"name": "text_search", "arguments": {"query": query, "top_k": 1}}),
            fmt.assistant_text(t2, response=answer),
        ]
    return plans


def picture(i: int) -> np.ndarray:
    """A deterministic synthetic picture (colour blocks and noise) for question ``i``."""
    rng = np.random.default_rng(SEED + i)
    img = rng.integers(0, 256, PICTURE_SHAPE, dtype=np.uint8)
    img[: PICTURE_SHAPE[0] // 2, : PICTURE_SHAPE[1] // 2] = rng.integers(0, 256, 3, dtype=np.uint8)
    return img


def question_folder(out: Path, answer: str | None = None) -> Path:
    """The scripted questions as a synthesize-shaped folder: ``rl.parquet`` and ``heldout.parquet`` (the same
    rows), ``images/`` and ``schemas.json`` (the short tool descriptions the agent checkpoint was
    fine-tuned with: it fails on the long ones). ``answer`` replaces every reference answer (a judge test's
    wrong reference). Returns ``out``."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (question, right, *_) in enumerate(PLANS):
        Image.fromarray(picture(i)).save(out / "images" / f"pic{i}.png")
        rows.append({"id": f"q{i}", "question": question, "answer": answer or right, "answer_aliases": [],
                     "images": [f"pic{i}.png"], "path": [{"title": right}]})
    for split in ("rl", "heldout"):
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    (out / "schemas.json").write_text(json.dumps([t.schema for t in agent_tools().values()]))
    return out


def agent_tools() -> dict[str, Any]:
    """The real crop and text_search tools, offered with one-line schemas.

    The registry's schemas are long for the tiny model's small vocabulary; the short form
    halves every sequence, which is what keeps fine-tuning and the tests that sample from
    this model fast on a small CPU machine. The functions are the real ones.
    """
    short = {
        "crop": ("Crop a region of an image.", {"image": "string", "x": "integer", "y": "integer",
                                                "width": "integer", "height": "integer"}),
        "text_search": ("Search text about an entity.", {"query": "string", "top_k": "integer"}),
    }
    out = {}
    for name, tool in all_tools().items():
        if name in short:
            desc, props = short[name]
            params = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                      "required": tool.parameters["required"]}
            out[name] = Tool(name, desc, params, tool.fn, backend=tool.backend, version=tool.version)
    return out


async def _teacher_records(processor: Any) -> list[tuple[Any, list[np.ndarray]]]:
    tools = agent_tools()
    schemas = [t.schema for t in tools.values()]
    teacher = ScriptedTeacher(agent_plans())
    env = build_env(tools=tools)  # the agent's environment with its default search settings
    client = env.client
    cfg = AgentConfig(max_turns=4, max_episode_tokens=2048)
    out = []
    for i, (question, answer, _) in enumerate(PLANS):
        row = {"id": f"scripted-{i}", "question": question, "answer": answer, "answer_aliases": []}
        store: dict[str, np.ndarray] = {}
        t = await run_episode(teacher, row, [picture(i)], client, cfg, processor=processor, tools=schemas,
                              image_store=store)
        out.append((t, [store[h] for h in t.images]))
    await env.aclose()
    return out


def finetune(model: Any, processor: Any, records: list[tuple[Any, list[np.ndarray]]], steps: int = TRAIN_STEPS,
             lr: float = LR) -> list[float]:
    """Plain AdamW on the model tokens of (trajectory, its image arrays) pairs, one per step; returns the losses."""
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    image_id = model.config.image_token_id
    batches = []
    for r, arrays in records:
        ids = torch.tensor([r.input_ids])
        vision = processor_inputs(arrays, r.image_max_pixels, processor)
        vision["mm_token_type_ids"] = mm_token_type_ids(ids, image_id)
        batches.append((ids, torch.tensor(r.gen_mask[1:], dtype=torch.float32), vision))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))
    losses = []
    for step in range(steps):
        ids, mask, vision = batches[step % len(batches)]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **vision).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def build(out: Path) -> dict[str, Any]:
    """Record the scripted teacher, fine-tune the tiny Qwen3-VL on it, save into ``out``."""
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    from osvl.models.load import load_model, load_processor  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    base = tiny_checkpoint("qwen3_vl")
    processor = load_processor(base)
    records = asyncio.run(_teacher_records(processor))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = load_model(base, dtype="float32")
        losses = finetune(model, processor, records)
    model.save_pretrained(out)
    for f in base.iterdir():  # tokenizer, processor configs, README: everything but the weights
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    (out / "README.md").write_text(
        "Tiny Qwen3-VL fine-tuned by osvl.agent.scripted on scripted crop -> text_search -> response "
        f"trajectories ({TRAIN_STEPS} steps, final loss {losses[-1]:.4f}). A test fixture, not a useful model.\n")
    return {"first_loss": losses[0], "final_loss": losses[-1]}


def build_key() -> str:
    blob = Path(__file__).read_bytes() + fmt.CHAT_TEMPLATE.encode() + tiny_key("qwen3_vl").encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tiny_agent_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The cached fine-tuned tiny agent checkpoint, built first if missing (atomic, like tiny.py)."""
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / "tiny"
    return build_once(root / f"qwen3_vl-agent-{build_key()}", build)
