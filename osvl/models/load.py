"""Load a local Hugging Face VLM checkpoint (Qwen3-VL, Qwen2.5-VL, Qwen2-VL) and its processor.

Two decisions live here so that no caller has to repeat them:

* **The image processor class is pinned.** Transformers picks the torchvision image processor
  when torchvision imports and the PIL/numpy one otherwise, and the two resize differently, so
  the same photo would give different ``pixel_values`` in the training environment (no
  torchvision) and the serving one (vLLM, with torchvision). We always build
  ``Qwen2VLImageProcessorPil`` from the checkpoint's image-processor settings, whatever class
  name the checkpoint asks for.
* **The multimodal processor is built explicitly.** Without torchvision, ``Qwen3VLProcessor``
  refuses to build (its video processor needs torchvision) and ``AutoProcessor`` on a saved
  directory quietly returns only the tokenizer. osvl feeds images, never video, so the
  processors below are the upstream classes minus the video processor.

Every processor and tokenizer loaded here gets ``osvl.chat.CHAT_TEMPLATE``; a
checkpoint's own template is never used (Qwen3 templates drop earlier ``<think>`` blocks, which
breaks token-exact multi-turn records).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers.models.qwen2_5_vl import processing_qwen2_5_vl
from transformers.models.qwen2_vl import processing_qwen2_vl
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl import processing_qwen3_vl

from osvl import storage
from osvl.chat import CHAT_TEMPLATE
from osvl.errors import ModelLoadError

PINNED_IMAGE_PROCESSOR = Qwen2VLImageProcessorPil
"""The one image processor class osvl uses, in every environment (see the module docstring)."""


class _ImagesOnly:
    """Drops the video processor from a Qwen processor.

    ``ProcessorMixin`` takes its list of sub-processors from the ``__init__`` signature, so an
    ``__init__`` without ``video_processor`` is all it takes: the upstream ``__init__`` then gets
    ``None`` for video and never type-checks it against the (torchvision-only) video class.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template)


# The subclasses keep the upstream class names on purpose: ProcessorMixin writes
# ``type(self).__name__`` into processor_config.json and tokenizer_config.json, and a saved
# directory must name the standard class so that other environments (vLLM) load it normally.
class Qwen3VLProcessor(_ImagesOnly, processing_qwen3_vl.Qwen3VLProcessor):
    """``transformers.Qwen3VLProcessor`` for images only, buildable without torchvision."""


class Qwen2_5_VLProcessor(_ImagesOnly, processing_qwen2_5_vl.Qwen2_5_VLProcessor):
    """``transformers.Qwen2_5_VLProcessor`` for images only, buildable without torchvision."""


class Qwen2VLProcessor(_ImagesOnly, processing_qwen2_vl.Qwen2VLProcessor):
    """``transformers.Qwen2VLProcessor`` for images only, buildable without torchvision."""


SUPPORTED: dict[str, tuple[str, type]] = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", Qwen3VLProcessor),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", Qwen3VLProcessor),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLProcessor),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", Qwen2VLProcessor),
}
"""config.json ``model_type`` -> (model class name in transformers, processor class)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# keys of a saved image-processor config that name classes rather than set the processing
_NOT_IMAGE_KWARGS = {"image_processor_type", "processor_class", "auto_map", "_processor_class"}


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def model_location(model: str) -> str:
    """Where a job's actors and workers find ``model``: a storage URI as it is (each node pulls its own copy
    through ``osvl.storage``), a local directory made absolute, or a Hugging Face hub id (``org/name``) as its
    snapshot in the local Hugging Face cache. Nothing is downloaded at run time (``HF_HUB_OFFLINE=1`` holds):
    fetch a hub model beforehand (``hf download org/name``) into a cache every node reads (``HF_HOME``)."""
    if storage.is_uri(model):
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if HUB_ID.fullmatch(model):
        try:
            return snapshot_download(model, local_files_only=True)
        except LocalEntryNotFoundError as e:
            raise ModelLoadError(f"model {model!r} is not in the Hugging Face cache: download it first "
                                 f"(hf download {model}); jobs never fetch from the hub") from e
    raise ModelLoadError(f"model {model!r}: not a checkpoint directory, a storage URI or a hub id (org/name)")


def read_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, after checking the directory and the architecture."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file} is not readable JSON: {e}") from e
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in SUPPORTED:
        raise ModelLoadError(
            f"{path}: unsupported architecture model_type={model_type!r}; supported: {', '.join(SUPPORTED)}"
        )
    return cfg


def _check_weights(path: Path) -> None:
    """Fail before transformers does: it would random-init whatever is missing, with only a warning."""
    if any((path / f).is_file() for f in WEIGHT_FILES):
        return
    for index in WEIGHT_INDEXES:
        if (path / index).is_file():
            try:
                shards = set(json.loads((path / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise ModelLoadError(f"{path / index} is not a valid weight index: {e}") from e
            missing = sorted(s for s in shards if not (path / s).is_file())
            if missing:
                raise ModelLoadError(f"{path}: incomplete checkpoint, missing weight shards {missing}")
            return
    raise ModelLoadError(f"{path}: no weights ({' / '.join(WEIGHT_FILES + WEIGHT_INDEXES)})")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = "cpu",
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """The VLM in ``path`` in eval mode, on ``device`` (None: where it was built; a ZeRO-3 partitioned
    model's parameters are already on the accelerator).

    ``dtype``: "auto" (as saved), "float32", "bfloat16", "float16" or a torch dtype.
    ``attn_implementation``: "sdpa", "eager", "flash_attention_2", ... or None for the
    transformers default. Any weight the checkpoint lacks is a ``ModelLoadError``, never a
    silently random-initialised tensor.

    The weights are read into CPU memory and then moved, rather than placed with ``device_map``:
    that needs ``accelerate``, and the large-model GPU paths (DeepSpeed, vLLM) load their own way.
    """
    path = Path(path)
    cfg = read_config(path)
    _check_weights(path)
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)} or a torch.dtype")
        dtype = DTYPES[dtype]
    cls = getattr(transformers, SUPPORTED[cfg["model_type"]][0])
    try:
        model, info = cls.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
        )
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from e
    if info["missing_keys"] or info.get("mismatched_keys"):
        raise ModelLoadError(
            f"{path}: weights do not match the architecture; missing {sorted(info['missing_keys'])[:5]}, "
            f"mismatched {list(info.get('mismatched_keys') or [])[:5]}"
        )
    try:
        if device is not None:
            model.to(device)
    except (RuntimeError, AssertionError) as e:  # AssertionError: torch built without CUDA
        raise ModelLoadError(f"cannot move {path} to device {device!r}: {e}") from e
    return model.eval()


def image_processor_kwargs(path: str | Path) -> dict[str, Any]:
    """The checkpoint's image-processing settings, wherever this transformers version saved them.

    Newer checkpoints nest them in processor_config.json, older ones (and every released Qwen
    checkpoint) keep preprocessor_config.json; class names in them are dropped, since the class
    is pinned.
    """
    path = Path(path)
    settings = None
    try:
        if (path / "processor_config.json").is_file():
            settings = json.loads((path / "processor_config.json").read_text()).get("image_processor")
        if settings is None and (path / "preprocessor_config.json").is_file():
            settings = json.loads((path / "preprocessor_config.json").read_text())
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: unreadable processor config: {e}") from e
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{path}: no image processor settings (processor_config.json / preprocessor_config.json)")
    return {k: v for k, v in settings.items() if k not in _NOT_IMAGE_KWARGS}


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer with osvl's chat template (text-only callers: judges, tests)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from e
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_processor(path: str | Path):
    """The full multimodal processor of the checkpoint in ``path``: pinned image processor, the
    checkpoint's tokenizer, osvl's chat template (see the module docstring for why)."""
    path = Path(path)
    cfg = read_config(path)
    try:
        image_processor = PINNED_IMAGE_PROCESSOR(**image_processor_kwargs(path))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad image processor settings: {e}") from e
    tokenizer = load_tokenizer(path)
    processor_cls = SUPPORTED[cfg["model_type"]][1]
    return processor_cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
