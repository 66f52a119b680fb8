"""The tiny random-init VLMs that tests and the demo run on CPU, as ordinary checkpoint directories.

``tiny_checkpoint("qwen3_vl")`` (or ``"qwen2_5_vl"``) returns a directory with config.json,
model.safetensors, tokenizer files, processor and image-processor configs and the osvl chat
template, that ``osvl.models.load`` (and any Hugging Face tool) loads like a released checkpoint.
It is built once and cached under ``$OSVL_CACHE`` (default ``~/.cache/osvl``), keyed by a hash of
everything that determines it: the size spec, the committed corpus, the chat format and the
library versions. Nothing is downloaded.

Simplifications, and why they are fine:

* Weights are random (seeded): the tests need the real architecture, shapes, vision path and
  gradients, not sensible text. Generation is garbage and is parsed as such.
* The tokenizer is a 4k byte-level BPE trained in about a second on ``corpus/corpus.txt``
  (Wikipedia text plus format examples), with every ChatML, format and vision token added as a
  single token, so token-level code (masks, step boundaries, stop tokens) is exercised exactly as
  with the real Qwen vocabulary, only smaller.
* The image processor caps an image at 64 vision tokens (``max_pixels``): a photo costs few
  tokens, which keeps a 1,000-token trajectory's forward+backward well under a second on CPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, get_args

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from osvl.chat import CHAT_TEMPLATE, SPECIAL_TOKENS
from osvl.errors import ConfigError
from osvl.storage import cache_root

CORPUS = Path(__file__).with_name("corpus") / "corpus.txt"
TinyKind = Literal["qwen3_vl", "qwen2_5_vl"]
KINDS = get_args(TinyKind)
BUILD_VERSION = 1  # bump when the build code changes in a way the hashed inputs do not show
SEED = 0
BPE_VOCAB = 4096
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# Qwen's own tokens that the chat format does not name but the model config and the upstream
# processor look up by id: the end-of-text/pad token and the (unused) video pad.
EXTRA_SPECIAL = [PAD, "<|video_pad|>"]

# Sizes per kind. Text: 128 wide, 4 layers, GQA 4/2 heads of 32. Vision: 2 blocks of 64.
# mrope_section splits head_dim/2 = 16 rotary frequencies among (time, height, width).
SPECS: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "text_config": {
            "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5],
                                "mrope_interleaved": True},
        },
        "vision_config": {
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128,
            "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1],
        },
        "image": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    },
    "qwen2_5_vl": {
        "text_config": {
            "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        },
        "vision_config": {
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128, "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "image": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                  "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711]},
    },
}
MIN_TOKENS, MAX_TOKENS = 4, 64  # vision tokens per image, after the 2x2 merge


def build_key(kind: str) -> str:
    """Hash of every input of the build; a change to any of them gives a new directory."""
    import torch
    import transformers

    key = {
        "kind": kind, "spec": SPECS[kind], "build": BUILD_VERSION, "seed": SEED, "bpe_vocab": BPE_VOCAB,
        "corpus": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
        "special": SPECIAL_TOKENS + EXTRA_SPECIAL, "template": CHAT_TEMPLATE,
        "versions": [torch.__version__, transformers.__version__, tokenizers.__version__],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def train_tokenizer():
    """Byte-level BPE on the committed corpus, wrapped as a transformers fast tokenizer.

    ``<|...|>`` tokens are special (dropped by ``skip_special_tokens``), the format tags are
    ordinary added tokens, as in the Qwen tokenizers, so decoded text keeps ``<think>`` etc.
    """
    from transformers import PreTrainedTokenizerFast

    special = [t for t in SPECIAL_TOKENS if t.startswith("<|")] + EXTRA_SPECIAL
    tags = [t for t in SPECIAL_TOKENS if not t.startswith("<|")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.read_text().split("\n\n"), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD)
    tok.add_tokens(tags)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def image_processor(kind: str):
    """The pinned image processor with tiny pixel limits (MIN_TOKENS..MAX_TOKENS vision tokens)."""
    from osvl.models.load import PINNED_IMAGE_PROCESSOR

    spec = SPECS[kind]["image"]
    factor = spec["patch_size"] * spec["merge_size"]  # one vision token covers factor x factor pixels
    return PINNED_IMAGE_PROCESSOR(
        min_pixels=MIN_TOKENS * factor * factor, max_pixels=MAX_TOKENS * factor * factor, **spec
    )


def model_config(kind: str, tok):
    """The transformers config of the tiny model, token ids taken from the tokenizer."""
    import transformers

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    vocab = -(-len(tok) // 64) * 64  # round up: embedding rows for every token, aligned
    text = dict(SPECS[kind]["text_config"], vocab_size=vocab, pad_token_id=tok.pad_token_id)
    if kind == "qwen2_5_vl":
        text.update(bos_token_id=None, eos_token_id=tok.eos_token_id)
    cls = {"qwen3_vl": transformers.Qwen3VLConfig, "qwen2_5_vl": transformers.Qwen2_5_VLConfig}[kind]
    return cls(text_config=text, vision_config=SPECS[kind]["vision_config"], **ids)


def build(kind: str, out: Path) -> None:
    """Write the tiny checkpoint of ``kind`` into the (empty) directory ``out``."""
    import torch
    import transformers

    from osvl.models.load import SUPPORTED

    tok = train_tokenizer()
    config = model_config(kind, tok)
    model_cls = getattr(transformers, SUPPORTED[kind][0])
    with torch.random.fork_rng(devices=[]):  # same weights for the same key, caller's RNG untouched
        torch.manual_seed(SEED)
        model = model_cls(config)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    processor = SUPPORTED[kind][1](image_processor=image_processor(kind), tokenizer=tok, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    # preprocessor_config.json as well: transformers 4.x (and so older vLLM) reads only that file
    processor.image_processor.save_pretrained(out)
    (out / "README.md").write_text(
        f"Tiny random-init {kind} built by osvl.models.tiny (key {out.name}). Not a trained model: "
        "weights are random; the tokenizer was trained on osvl/models/corpus (CC BY-SA, see ATTRIBUTION.md).\n"
    )


def build_once(final: Path, build_fn: Any) -> Path:
    """``final``, built first by ``build_fn(tmp_dir)`` if missing.

    The build writes into a temporary sibling directory and renames it into place, and rename
    is atomic, so parallel processes either see a complete checkpoint or none; a process that
    loses the race discards its copy.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_fn(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_name(kind: str) -> str:
    """The folder name of ``kind``'s checkpoint: it changes whenever its weights or tokenizer would, so a
    run keyed by it (``SftConfig.tiny_kind`` hashes as this) never resumes another model's checkpoint."""
    if kind not in KINDS:
        raise ConfigError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS)}")
    return f"{kind}-{build_key(kind)}"


def tiny_checkpoint(kind: str = "qwen3_vl", cache_dir: str | Path | None = None) -> Path:
    """The cached tiny checkpoint directory of ``kind``, built first if missing (see ``build_once``)."""
    final = (Path(cache_dir) if cache_dir is not None else cache_root()) / "tiny" / checkpoint_name(kind)
    return build_once(final, lambda tmp: build(kind, tmp))
