"""EDSR super-resolution: basicsr checkpoints, the committed weights on Set5/Set14, limits, the training job."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from osvl.errors import ModelLoadError, WeightsMissingError
from osvl.tools.base import REGISTRY, InvalidCall, ToolContext, call_tool
from osvl.tools.super_resolution import (
    DEFAULT_WEIGHTS,
    bicubic_upscale,
    build_model,
    edsr_device,
    evaluate,
    load_model,
    make_lr,
    modcrop,
    psnr_y,
    read_rgb,
    save_checkpoint,
    upscale_batch,
)


@pytest.fixture(scope="module")
def committed():
    return load_model(DEFAULT_WEIGHTS)


def _set(shared_data, name):
    return {p.stem: read_rgb(p) for p in sorted((shared_data / "images" / "sr" / name).glob("*.png"))}


@pytest.mark.slow  # a fresh interpreter importing torch
def test_edsr_class_is_basicsr_code_without_torchvision():
    code = ("import sys\n"
            "from osvl.tools.super_resolution import _basicsr_edsr_class\n"
            "cls = _basicsr_edsr_class()\n"
            "print(cls.__name__, cls.forward.__code__.co_filename, 'torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "EDSR"
    assert out[1].replace("\\", "/").endswith("basicsr/archs/edsr_arch.py")
    assert out[2] == "False"


@pytest.mark.parametrize("num_feat, num_block, upscale", [
    pytest.param(64, 16, 4, marks=pytest.mark.slow),  # the official EDSR-M x4 shape
    (16, 2, 2), (16, 2, 3),
])
def test_official_basicsr_checkpoint_loads_unchanged(tmp_path, num_feat, num_block, upscale):
    """A basicsr-format file (``params_ema``, fp32, no osvl metadata) gives the plain EDSR forward."""
    import torch

    torch.manual_seed(0)
    edsr = build_model(num_feat, num_block, upscale, bicubic_skip=False).edsr.eval()
    path = tmp_path / "official.pth"
    torch.save({"params_ema": edsr.state_dict()}, path)
    model = load_model(path)
    assert model.meta == {"num_feat": num_feat, "num_block": num_block, "upscale": upscale,
                          "bicubic_skip": False, "res_scale": 1.0}
    x = torch.rand(1, 3, 12, 10)
    with torch.no_grad():
        torch.testing.assert_close(model(x), edsr(x))
    (out,) = upscale_batch(model, [np.zeros((12, 10, 3), np.uint8)])
    assert out.shape == (12 * upscale, 10 * upscale, 3)


def test_osvl_checkpoint_roundtrip_keeps_skip_flag_and_fp16(tmp_path):
    import torch

    torch.manual_seed(1)
    model = build_model(8, 1, 4, bicubic_skip=True)
    with torch.no_grad():
        model.edsr.conv_last.weight.normal_(0, 0.01)
    save_checkpoint(model.eval(), tmp_path / "w.pth", extra={"steps": 7})
    raw = torch.load(tmp_path / "w.pth", weights_only=True)
    assert raw["params"]["conv_first.weight"].dtype == torch.float16
    assert raw["osvl"]["bicubic_skip"] is True and raw["osvl"]["steps"] == 7
    back = load_model(tmp_path / "w.pth")
    assert back.bicubic_skip and back.meta["steps"] == 7
    img = np.random.default_rng(0).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    a, b = upscale_batch(model, [img])[0], upscale_batch(back, [img])[0]
    assert np.abs(a.astype(int) - b).max() <= 1  # fp16 storage


def test_zero_residual_model_is_exactly_bicubic():
    """The skip model at init outputs bicubic: the baseline it is trained to beat is the one we report."""
    img = np.random.default_rng(2).integers(0, 256, (16, 20, 3), dtype=np.uint8)
    (out,) = upscale_batch(build_model(8, 1, 4).eval(), [img])
    np.testing.assert_array_equal(out, bicubic_upscale(img, 4))


def test_missing_and_broken_weights_are_typed_errors(tmp_path):
    with pytest.raises(WeightsMissingError, match="train_edsr"):
        load_model(tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="not a readable"):
        load_model(tmp_path / "junk.pth")
    import torch

    torch.save({"state_dict": {}}, tmp_path / "other.pth")
    with pytest.raises(ModelLoadError, match="params"):
        load_model(tmp_path / "other.pth")
    img = {"img_1": np.zeros((8, 8, 3), np.uint8)}
    r = call_tool(REGISTRY["super_resolution"], {"image": "img_1"},
                  ToolContext(images=img, options={"edsr_weights": str(tmp_path / "nope.pth")}))
    assert r.status == "error" and r.error.kind == "unavailable"
    assert "WeightsMissing" in r.error.message or "not found" in r.error.message
    assert not r.images


def test_pixel_caps_are_limit_errors():
    model = build_model(8, 1, 4).eval()
    with pytest.raises(InvalidCall) as e:
        upscale_batch(model, [np.zeros((600, 600, 3), np.uint8)])
    assert e.value.limit and "exceeds" in str(e.value)
    ctx = ToolContext(images={"img_1": np.zeros((600, 600, 3), np.uint8)}, options={"edsr": model})
    r = call_tool(REGISTRY["super_resolution"], {"image": "img_1"}, ctx)
    assert r.error.kind == "invalid_call" and r.error.limit
    # the output cap of the context counts too (x4 = 16x the input pixels)
    ctx = ToolContext(images={"img_1": np.zeros((40, 40, 3), np.uint8)}, options={"edsr": model}, max_pixels=20_000)
    r = call_tool(REGISTRY["super_resolution"], {"image": "img_1"}, ctx)
    assert r.error.kind == "invalid_call" and r.error.limit and "output" in r.error.message


@pytest.mark.parametrize("scale, needle", [(3, "not available"), ("4", "must be a number"),
                                           (float("nan"), "finite"), (8, "must be in"), (4.5, "integer")])
def test_bad_scale_is_invalid_call(scale, needle):
    ctx = ToolContext(images={"img_1": np.zeros((8, 8, 3), np.uint8)}, options={"edsr": build_model(8, 1, 4)})
    r = call_tool(REGISTRY["super_resolution"], {"image": "img_1", "scale": scale}, ctx)
    assert r.error.kind == "invalid_call" and needle in r.error.message


def test_batch_equals_single_calls_and_rejects_mixed_sizes():
    import torch

    torch.manual_seed(3)
    model = build_model(8, 1, 4)
    with torch.no_grad():
        model.edsr.conv_last.weight.normal_(0, 0.01)
    model.eval()
    rng = np.random.default_rng(4)
    imgs = [rng.integers(0, 256, (10, 14, 3), dtype=np.uint8) for _ in range(3)]
    batch = upscale_batch(model, imgs)
    for img, out in zip(imgs, batch, strict=True):
        assert np.abs(upscale_batch(model, [img])[0].astype(int) - out).max() <= 1
    with pytest.raises(InvalidCall, match="one size"):
        upscale_batch(model, [imgs[0], imgs[0][:5]])
    assert upscale_batch(model, []) == []


def test_psnr_y_reference_values():
    a = np.zeros((20, 20, 3), np.uint8)
    assert psnr_y(a, a) == math.inf
    b = a.copy()
    b[..., 1] = 10  # Y differs by 10 * 128.553 / 255 everywhere
    assert psnr_y(a, b) == pytest.approx(20 * math.log10(255 / (10 * 128.553 / 255)))
    b[:4] = 255  # the shaved border does not count
    assert psnr_y(a, b, shave=4) == pytest.approx(20 * math.log10(255 / (10 * 128.553 / 255)))
    hr = modcrop(np.zeros((13, 18, 3), np.uint8), 4)
    assert hr.shape == (12, 16, 3) and make_lr(hr, 4).shape == (3, 4, 3)


def test_committed_weights_are_small_and_documented(committed):
    assert DEFAULT_WEIGHTS.stat().st_size <= 5 * 1024 * 1024
    assert committed.bicubic_skip and committed.upscale == 4
    assert committed.meta["steps"] > 0


def test_tool_upscales_x4(committed):
    img = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    r = call_tool(REGISTRY["super_resolution"], {"image": "img_1"},
                  ToolContext(images={"img_1": img}, options={"edsr": committed}))
    assert r.ok, r.text
    assert r.images["img_2"].shape == (120, 160, 3)
    assert r.text == "Upscaled img_1 x4 to 160x120 as img_2."


@pytest.mark.slow
def test_committed_weights_beat_bicubic_on_every_set5_image(committed, shared_data):
    rows = evaluate(committed, _set(shared_data, "Set5"))
    assert len(rows) == 5
    for row in rows:
        assert row["edsr"] > row["bicubic"], row


@pytest.mark.slow
def test_committed_weights_beat_bicubic_on_set14_mean(committed, shared_data):
    rows = evaluate(committed, _set(shared_data, "Set14"))
    assert len(rows) == 14
    assert np.mean([r["edsr"] for r in rows]) > np.mean([r["bicubic"] for r in rows]) + 0.2
    assert sum(r["edsr"] > r["bicubic"] for r in rows) >= 12


@pytest.mark.slow
def test_train_job_runs_checkpoints_resumes_and_exports(tmp_path, shared_data, ray_cluster):
    sys.path.insert(0, str(DEFAULT_WEIGHTS.parents[3] / "jobs"))
    import train_edsr

    argv = [f"--run.root={tmp_path}", f"--data.photo_dirs={shared_data / 'images' / 'opencv'}",
            "--data.skimage=", f"--export_to={tmp_path / 'export' / 'edsr.pth'}"]
    first = train_edsr.main(argv)
    model = load_model(first["exported"])
    assert model.meta["steps"] == 4 and model.meta["num_feat"] == 8
    run = tmp_path / "train_edsr"
    (folder,) = [p for p in run.iterdir() if not p.is_symlink()]
    assert (run / "latest").resolve() == folder.resolve()  # osvl.tracking: the job's newest run
    assert json.loads((folder / "report.json").read_text())["meta"]["steps"] == 4
    checkpoints = sorted(p.name for p in (folder / "train").glob("checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 2  # steps 2 and 4 (ckpt_every=2), both kept
    # the same config again resumes from the finished run's last checkpoint instead of training anew:
    # same folder, no new checkpoint, same weights
    second = train_edsr.main(argv)
    assert second["meta"] == first["meta"]
    assert [p for p in run.iterdir() if not p.is_symlink()] == [folder]
    assert sorted(p.name for p in (folder / "train").glob("checkpoint_*") if p.is_dir()) == checkpoints


@pytest.mark.parametrize("cuda, gpu_ids, expected", [
    (False, None, "cpu"),     # a script on a CPU machine
    (True, None, "cuda"),     # a script on a GPU machine (bench/gpu_check.sh)
    (False, [0], "cpu"),      # a replica that reserved a logical GPU on a node without CUDA
    (True, [], "cpu"),        # a replica that reserved no GPU on a GPU node: not its GPU to take
    (True, [0], "cuda"),      # a replica Ray gave a GPU, CUDA present
])
def test_edsr_device_rule(cuda, gpu_ids, expected):
    assert edsr_device(cuda, gpu_ids) == expected


_LOGICAL_GPU = """
import json, ray, torch
from osvl.cluster import init_ray
from osvl.tools.super_resolution import edsr_device, load_model

@ray.remote
def probe():
    model = load_model()
    p = next(model.parameters())
    return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "device": str(p.device), "dtype": str(p.dtype),
            "if_cuda": edsr_device(cuda_available=True)}

init_ray(num_cpus=2, num_gpus=1, include_dashboard=False)
out = ray.get([probe.options(num_gpus=1).remote(), probe.options(num_gpus=0).remote()])
print(json.dumps(out))
ray.shutdown()
"""


@pytest.mark.slow  # its own one-CPU Ray cluster with a logical GPU (~10 s)
def test_edsr_on_a_logical_gpu_node_stays_on_cpu_and_follows_ray_assignment():
    """Ray workers: a logical GPU (no CUDA) keeps EDSR on CPU; with CUDA, only the GPU-assigned worker uses it."""
    proc = subprocess.run([sys.executable, "-c", _LOGICAL_GPU], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_gpu, without = json.loads(proc.stdout.strip().splitlines()[-1])
    assert with_gpu["gpu_ids"] == ["0"] and without["gpu_ids"] == []
    if not __import__("torch").cuda.is_available():
        assert with_gpu["device"] == without["device"] == "cpu"
        assert with_gpu["dtype"] == "torch.float32"
    assert with_gpu["if_cuda"] == "cuda" and without["if_cuda"] == "cpu"
