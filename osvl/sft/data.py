"""SFT's input: trajectory part files, the question-level validation split, Ray Data splits and batches.

The data order is a function of the data and ``(seed, epoch)`` only (see ``osvl/sft/job.py``),
so a resumed run reproduces it by skipping the micro-batches already done.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from osvl.chat import IM_START
from osvl.errors import DataError

COLUMNS = ["id", "question_id", "input_ids", "gen_mask", "step_ids", "images", "image_max_pixels"]


def parquet_files(path: str | Path) -> tuple[list[Path], Path]:
    """(part files, image folder) of a trajectory folder or its ``trajectories.parquet``."""
    p = Path(path)
    if (p / "trajectories.parquet").exists():
        p = p / "trajectories.parquet"
    files = sorted(p.glob("part-*.parquet")) if p.is_dir() else [p]
    files = [f for f in files if f.is_file() and f.stat().st_size > 0]
    if not files:
        raise DataError(f"no trajectory parquet at {path}")
    return files, p.parent / "images"


def check_tokenizer(file: Path, model_dir: str) -> None:
    """Refuse records rendered with another tokenizer than ``model_dir``'s.

    A record stores token ids, not text, so another tokenizer's records train on other words
    without any error. The prompt before the first generated token is the chat template's own
    rendering: with the right tokenizer it reads as a ChatML turn (a short garbled prompt can
    still encode back to its ids) and encodes back to the same ids.
    """
    from osvl.models.load import load_processor  # noqa: PLC0415 (d) keeps transformers out of jobs/grpo.py --help

    first = next(pq.ParquetFile(file).iter_batches(batch_size=1, columns=["id", "input_ids", "gen_mask"]), None)
    if first is None or first.num_rows == 0:
        return
    row = first.to_pylist()[0]
    ids, mask = row["input_ids"], row["gen_mask"]
    prompt = ids[:next((i for i, m in enumerate(mask) if m), len(ids))]
    processor = load_processor(model_dir)
    tok = getattr(processor, "tokenizer", processor)
    text = tok.decode(prompt, skip_special_tokens=False)
    again = tok(text, add_special_tokens=False)["input_ids"]
    if not text.startswith((f"{IM_START}system\n", f"{IM_START}user\n")) or list(again) != list(prompt):
        raise DataError(f"{file}: record {row['id']} was not rendered with the tokenizer of {model_dir} (its "
                        "prompt does not encode back to the same ids): make the records with the trajectories "
                        "job's model or tiny_kind set to this model")


def is_val(question_id: str, fraction: float) -> bool:
    """Deterministic question-level split (crc32 of the id), so trajectories of one question stay together."""
    return zlib.crc32(question_id.encode()) % 10_000 < fraction * 10_000


def count_rows(files: list[Path], val_fraction: float) -> tuple[int, int]:
    """(train rows, validation rows), from the question-id column only."""
    n_train = n_val = 0
    for f in files:
        for qid in pq.read_table(f, columns=["question_id"]).column(0).to_pylist():
            if is_val(qid, val_fraction):
                n_val += 1
            else:
                n_train += 1
    return n_train, n_val


def long_rows(files: list[Path], max_len: int) -> tuple[int, int, int]:
    """(rows longer than ``max_len``, all rows, the longest row's tokens), from the token column's lengths.

    Why: a trajectory's last turn is its answer, so a row cut at ``max_len`` trains every turn but the
    one that scores. The demo once trained on 6 answers in 392 rows this way (max_len 1536, rows of
    ~1,900 tokens) and its policy never answered; the count is logged before training, not after.
    """
    n_long = n = longest = 0
    for f in files:
        lengths = pc.list_value_length(pq.read_table(f, columns=["input_ids"]).column(0))
        n += len(lengths)
        if len(lengths):
            n_long += int(pc.sum(pc.greater(lengths, max_len)).as_py() or 0)
            longest = max(longest, int(pc.max(lengths).as_py()))
    return n_long, n, longest


def load_split(files: list[Path], val_fraction: float, val: bool):
    """The train or validation rows (token columns only) as a Ray Dataset in the object store.

    Read here, in the driver, from the files it already holds (a local folder, or this node's
    mirror of the run root: ``count_rows`` read them too), one block per file in file order, so
    the block layout, and with it every epoch's order, is the same in a resumed run. Not
    ``ray.data.read_parquet``: its listing and read tasks start worker processes, on other nodes
    of a cluster, which costs more than the read at the sizes osvl trains (token ids of thousands
    of trajectories); the blocks land in the object store either way and the train workers stream
    them from there. The driver holds one split in memory while it puts it there; a set too big
    for that wants the read tasks back.
    """
    import ray.data  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    tables = []
    for f in files:
        t = pq.read_table(f, columns=COLUMNS)
        keep = [is_val(q, val_fraction) == val for q in t.column("question_id").to_pylist()]
        tables.append(t.filter(pa.array(keep, pa.bool_())))
    return ray.data.from_arrow(tables)


def global_batches(ds, *, rows: int, drop_last: bool, shuffle_buffer: int = 0, seed: int = 0):
    """Yield lists of ``rows`` records of ``ds``, shuffled by a buffer seeded with ``seed`` (0 rows: in order)."""
    import ray.data  # noqa: PLC0415 (d) keeps ray out of jobs/grpo.py --help

    ray.data.DataContext.get_current().enable_progress_bars = False
    kw: dict[str, Any] = {}
    if shuffle_buffer > 1:
        kw = {"local_shuffle_buffer_size": shuffle_buffer, "local_shuffle_seed": seed}
    for batch in ds.iter_batches(batch_size=rows, batch_format="pyarrow", drop_last=drop_last, **kw):
        yield [SimpleNamespace(logprobs=[], **r) for r in batch.to_pylist()]


