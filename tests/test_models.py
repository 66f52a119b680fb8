"""osvl.models.load and osvl.models.tiny: checkpoint loading, the pinned processor, the tiny-model cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from osvl import storage
from osvl.chat import CHAT_TEMPLATE, SPECIAL_TOKENS
from osvl.errors import ConfigError, ModelLoadError
from osvl.models import tiny
from osvl.models.load import PINNED_IMAGE_PROCESSOR, load_model, load_processor

REPO = Path(__file__).resolve().parents[1]

# Image-processor settings exactly as the released checkpoints ship them (preprocessor_config.json
# of Qwen/Qwen3-VL-4B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct), class names included: the class
# they ask for needs torchvision and must be ignored.
QWEN3_RELEASE = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN25_RELEASE = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}

# pixel_values of synthetic_image() under the pinned class: (shape, grid, digest of values rounded to 1e-3).
# Computed once with Qwen2VLImageProcessorPil (transformers 5.24, Pillow resampling); a change here means
# the same photo no longer gives the model the same pixels.
PINNED = {
    "tiny_qwen3_vl": ((96, 1536), [1, 8, 12], "70c4695892e95922"),
    "tiny_qwen2_5_vl": ((112, 1176), [1, 8, 14], "a234881667fd6d44"),
    "qwen3_release": ((308, 1536), [1, 14, 22], "e16f60e01903fbe3"),
    "qwen2_5_release": ((112, 1176), [1, 8, 14], "a234881667fd6d44"),
}


def synthetic_image(h: int = 120, w: int = 200) -> np.ndarray:
    """Gradients plus a high-frequency channel, so resampling differences would show."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x * 7 + y * 13) % 256], -1).astype(np.uint8)


def release_kwargs(settings: dict) -> dict:
    """The processing settings of a release config, without the class names."""
    return {k: v for k, v in settings.items() if k not in ("processor_class", "image_processor_type")}


def digest(pixel_values) -> str:
    q = np.round(np.asarray(pixel_values, dtype=np.float64) * 1000).astype(np.int32)
    return hashlib.sha256(q.tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def qwen3_dir() -> Path:
    return tiny.tiny_checkpoint("qwen3_vl")


def copy_without(src: Path, dst: Path, *skip: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


# ---------------------------------------------------------------- pinned image processor


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_pixel_values(name, qwen3_dir):
    if name.startswith("tiny_"):
        processor = load_processor(tiny.tiny_checkpoint(name.removeprefix("tiny_")))
        image_processor = processor.image_processor
    else:
        settings = QWEN3_RELEASE if name == "qwen3_release" else QWEN25_RELEASE
        image_processor = PINNED_IMAGE_PROCESSOR(**release_kwargs(settings))
    out = image_processor(images=[synthetic_image()], return_tensors="np")
    shape, grid, want = PINNED[name]
    assert out["pixel_values"].shape == shape
    assert out["image_grid_thw"].tolist() == [grid]
    assert digest(out["pixel_values"]) == want


@pytest.mark.parametrize("settings", [QWEN3_RELEASE, QWEN25_RELEASE])
def test_release_style_configs_get_the_pinned_class(settings, qwen3_dir, tmp_path):
    """A checkpoint asking for the torchvision ("Fast") class still gets the PIL one, with its settings."""
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt", "processor_config.json", "preprocessor_config.json",
                        "model.safetensors")
    (ckpt / "preprocessor_config.json").write_text(json.dumps(settings))
    processor = load_processor(ckpt)
    assert type(processor.image_processor) is PINNED_IMAGE_PROCESSOR
    assert processor.image_processor.patch_size == settings["patch_size"]
    image = synthetic_image()
    direct = PINNED_IMAGE_PROCESSOR(**release_kwargs(settings))(images=[image], return_tensors="np")
    via = processor.image_processor(images=[image], return_tensors="np")
    np.testing.assert_array_equal(via["pixel_values"], direct["pixel_values"])


def test_processor_is_full_multimodal_with_osvl_template(qwen3_dir):
    processor = load_processor(qwen3_dir)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert type(processor.image_processor) is PINNED_IMAGE_PROCESSOR
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE
    out = processor(images=[synthetic_image()], text=["<|vision_start|><|image_pad|><|vision_end|>img_1"],
                    return_tensors="pt")
    assert {"input_ids", "pixel_values", "image_grid_thw"} <= set(out)


def test_checkpoint_template_is_never_used(qwen3_dir, tmp_path):
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt", "model.safetensors")
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template="bogus")))
    processor = load_processor(ckpt)
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE


# ---------------------------------------------------------------- model loading


def test_load_model_options(qwen3_dir):
    model = load_model(qwen3_dir, dtype="bfloat16", device="cpu", attn_implementation="eager")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert load_model(qwen3_dir, dtype=torch.float32).dtype == torch.float32


def test_loaded_weights_are_the_saved_ones(qwen3_dir):
    from safetensors.torch import load_file

    saved = load_file(qwen3_dir / "model.safetensors")
    params = dict(load_model(qwen3_dir).named_parameters())
    name = next(k for k in saved if "embed_tokens" in k)
    loaded = next(v for k, v in params.items() if k.endswith(name.split("model.", 1)[-1]))
    torch.testing.assert_close(loaded, saved[name], rtol=0, atol=0)


def test_qwen3_vl_moe_checkpoint_loads_and_runs(qwen3_dir, tmp_path):
    """The MoE member of the Qwen3-VL family: a tiny one made here from the tiny dense config."""
    import transformers

    ckpt = copy_without(qwen3_dir, tmp_path / "moe", "model.safetensors", "config.json")
    dense = json.loads((qwen3_dir / "config.json").read_text())
    text = {k: v for k, v in dense["text_config"].items() if k != "model_type"}
    text.update(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    vision = {k: v for k, v in dense["vision_config"].items() if k != "model_type"}
    ids = {k: dense[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(ckpt)
    model, processor = load_model(ckpt), load_processor(ckpt)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    inputs = processor(images=[synthetic_image()], text=["<|vision_start|><|image_pad|><|vision_end|>img_1 what?"],
                       return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_processor(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(qwen3_dir, tmp_path):
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture model_type='llama'"):
        load_model(ckpt)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_processor(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        load_model(ckpt)


def test_missing_weights(qwen3_dir, tmp_path):
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt", "model.safetensors")
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(ckpt)
    # a sharded checkpoint whose index names a shard that is not there
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(qwen3_dir / "model.safetensors", ckpt / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing weight shards \['model-00002-of-00002.safetensors'\]"):
        load_model(ckpt)


def test_weights_of_another_architecture_are_refused(qwen3_dir, tmp_path):
    """More layers in config.json than in the weights: transformers would random-init them silently."""
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] += 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match the architecture"):
        load_model(ckpt)


def test_missing_processor_files(qwen3_dir, tmp_path):
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt", "processor_config.json", "preprocessor_config.json")
    with pytest.raises(ModelLoadError, match="no image processor settings"):
        load_processor(ckpt)
    ckpt = copy_without(qwen3_dir, tmp_path / "ckpt2", "tokenizer*")
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_processor(ckpt)


def test_bad_dtype_attention_and_device(qwen3_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(qwen3_dir, dtype="float8")
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(qwen3_dir, attn_implementation="no_such_attention")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="cannot move"):
            load_model(qwen3_dir, device="cuda")


# ---------------------------------------------------------------- tiny checkpoints


def test_tiny_tokenizer_keeps_format_tokens_whole(qwen3_dir):
    tok = load_processor(qwen3_dir).tokenizer
    for t in SPECIAL_TOKENS + ["<|endoftext|>"]:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [t], t
    text = '<think>a</think>\n<tool_call>{"name": "crop", "arguments": {"image": "img_1"}}</tool_call><|im_end|>'
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|im_end|>"
    assert len(tok) < 4200  # a tiny vocabulary: embedding and softmax stay small


def test_tiny_checkpoint_directory_contents(qwen3_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
              "preprocessor_config.json", "chat_template.jinja", "generation_config.json"):
        assert (qwen3_dir / f).is_file(), f
    assert json.loads((qwen3_dir / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    assert (qwen3_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (qwen3_dir / "model.safetensors").stat().st_size < 20_000_000


def test_tiny_checkpoint_is_cached(qwen3_dir):
    before = (qwen3_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny.tiny_checkpoint("qwen3_vl") == qwen3_dir
    assert (qwen3_dir / "model.safetensors").stat().st_mtime_ns == before
    assert qwen3_dir.name == f"qwen3_vl-{tiny.build_key('qwen3_vl')}"
    assert tiny.build_key("qwen3_vl") != tiny.build_key("qwen2_5_vl")


def test_cache_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OSVL_CACHE", str(tmp_path / "c"))
    assert storage.cache_root() == tmp_path / "c"
    monkeypatch.delenv("OSVL_CACHE")
    assert storage.cache_root() == Path.home() / ".cache" / "osvl"


def test_unknown_kind():
    with pytest.raises(ConfigError, match="unknown tiny model kind"):
        tiny.tiny_checkpoint("llama")


@pytest.mark.slow
def test_parallel_builds_are_atomic(tmp_path):
    """Two processes build into one empty cache at once: both get the same complete directory, no debris."""
    code = ("import sys; from osvl.models.tiny import tiny_checkpoint; "
            "print(tiny_checkpoint('qwen3_vl', cache_dir=sys.argv[1]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    built = Path(outs[0])
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == [built.name]  # temp dirs removed
    load_model(built)
    load_processor(built)


def test_import_osvl_models_is_light():
    code = "import sys, osvl.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_hub_id_loads_from_the_local_cache_offline_and_a_missing_one_says_how_to_get_it(qwen3_dir, tmp_path):
    """``--model=org/name`` resolves in the Hugging Face cache (the layout ``hf download`` writes) with
    ``HF_HUB_OFFLINE=1``; nothing is fetched. Run in a child process: huggingface_hub reads its cache location
    from the environment when it is imported."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--osvl--tiny-qwen3-vl"
    shutil.copytree(qwen3_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = ("import sys; from osvl.models.load import load_model, model_location\n"
            "path = model_location(sys.argv[1]); load_model(path); print(path)")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code, "osvl/tiny-qwen3-vl"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(repo / "snapshots" / commit)
    done = subprocess.run([sys.executable, "-c", code, "osvl/not-downloaded"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "model 'osvl/not-downloaded' is not in the Hugging Face cache: download it first" in done.stderr


def test_model_locations_keep_a_uri_and_make_a_directory_absolute(qwen3_dir, monkeypatch):
    from osvl.models.load import model_location

    assert model_location("s3://bucket/models/policy") == "s3://bucket/models/policy"
    monkeypatch.chdir(qwen3_dir.parent)
    assert model_location(qwen3_dir.name) == str(qwen3_dir.resolve())
    with pytest.raises(ModelLoadError, match="not a checkpoint directory, a storage URI or a hub id"):
        model_location("no such dir")
