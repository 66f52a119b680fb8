"""``super_resolution``: x4 upscaling with basicsr's EDSR, plus the PSNR-Y reference used to judge it.

The network is basicsr's own ``EDSR`` class, so official basicsr checkpoints
(``{"params": ...}`` or ``{"params_ema": ...}``) load unchanged. Importing
``basicsr`` normally runs its package ``__init__``, which imports its data,
training and metric modules and, through ``archs/arch_util.py``, ``torchvision``
(not installable in this venv). EDSR itself only needs three small definitions
of ``arch_util`` (``make_layer``, ``ResidualBlockNoBN``, ``Upsample``, and the
``default_init_weights`` they call). ``_basicsr_edsr_class`` therefore reads the
two installed source files, executes exactly those definitions (basicsr's code,
not a copy, and nothing stubbed), and returns the real ``EDSR`` class.

No EDSR weights can be downloaded here, so the project trains its own
(``jobs/train_edsr.py``) and commits them in ``osvl/tools/weights/``. Those use
an optional *bicubic skip*: the output is ``bicubic(x) + (EDSR(x) - mean)``, i.e.
the EDSR body predicts only the detail that bicubic misses. That makes a small
model trained for minutes on CPU beat bicubic reliably; the official EDSR has no
such skip, so the flag is stored in the checkpoint's ``osvl`` metadata and is
off for any checkpoint without it.

Device: ``load_model`` puts the network where ``edsr_device`` says. Inside a Ray worker that
is CUDA only when Ray assigned the worker a GPU *and* CUDA works there: a replica that reserved
``num_gpus`` on a node whose GPUs are logical (``ray start --num-gpus=1`` on a CPU machine, as in
tests) must stay on CPU, and one that reserved no GPU must not take memory on a GPU another actor
owns. Outside Ray (a script, ``bench/gpu_check.sh``) CUDA is used when present. On CUDA the model
runs in half precision (EDSR has no batch norm; fp16 convolutions are what the GPU is fast at);
``upscale_batch`` moves each batch to the model's device and dtype.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from osvl.errors import DependencyMissingError, ModelLoadError, WeightsMissingError
from osvl.tools.base import IMAGE_ARG, InvalidCall, Tool, ToolContext, ToolResult, number, register

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "edsr_x4.pth"
MAX_INPUT_PIXELS = 512 * 512
"""Largest input EDSR runs on in one piece: activations at the x2 stage of a num_feat=32 model
take about 2 KB per input pixel, so this keeps one call near 0.5 GB (tiling is not implemented)."""

BASICSR_INSTALL = "pip install --no-deps basicsr==1.4.2"
_ARCH_UTIL_NAMES = {"default_init_weights", "make_layer", "ResidualBlockNoBN", "Upsample"}


def _keep_import(node: ast.stmt) -> bool:
    """Top-level imports of basicsr's files that EDSR needs (torch, math); drop torchvision/basicsr/distutils."""
    if isinstance(node, ast.Import):
        roots = {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
        roots = {(node.module or "").split(".")[0]}
    else:
        return False
    return not roots & {"torchvision", "basicsr", "distutils"}


@cache
def _basicsr_edsr_class() -> type:
    spec = importlib.util.find_spec("basicsr")  # finds the package without executing its __init__
    if spec is None or not spec.submodule_search_locations:
        raise DependencyMissingError("basicsr", BASICSR_INSTALL, "EDSR architecture for super_resolution")
    archs = Path(spec.submodule_search_locations[0]) / "archs"
    namespace: dict[str, Any] = {"__name__": "osvl_basicsr_edsr"}
    util = ast.parse((archs / "arch_util.py").read_text())
    util.body = [n for n in util.body if _keep_import(n) or getattr(n, "name", None) in _ARCH_UTIL_NAMES]
    exec(compile(util, str(archs / "arch_util.py"), "exec"), namespace)  # noqa: S102 - installed basicsr source
    edsr = ast.parse((archs / "edsr_arch.py").read_text())
    for node in edsr.body:
        if isinstance(node, ast.ClassDef):
            node.decorator_list = []  # @ARCH_REGISTRY.register() only records the class in basicsr's registry
    edsr.body = [n for n in edsr.body if not isinstance(n, ast.Import | ast.ImportFrom) or _keep_import(n)]
    exec(compile(edsr, str(archs / "edsr_arch.py"), "exec"), namespace)  # noqa: S102
    return namespace["EDSR"]


def _torch():
    import torch  # noqa: PLC0415 (d) keeps torch out of jobs/ask.py --help

    return torch


def build_model(num_feat: int = 32, num_block: int = 8, upscale: int = 4, bicubic_skip: bool = True,
                res_scale: float = 1.0) -> Any:
    """An ``SRNet`` (basicsr EDSR + optional bicubic skip) with fresh weights."""
    torch = _torch()

    class SRNet(torch.nn.Module):
        """basicsr ``EDSR`` in ``self.edsr``; its ``state_dict`` is what checkpoints store as ``params``."""

        def __init__(self) -> None:
            super().__init__()
            self.edsr = _basicsr_edsr_class()(3, 3, num_feat=num_feat, num_block=num_block, upscale=upscale,
                                              res_scale=res_scale)
            self.upscale = upscale
            self.bicubic_skip = bicubic_skip
            self.meta = {"num_feat": num_feat, "num_block": num_block, "upscale": upscale,
                         "bicubic_skip": bicubic_skip, "res_scale": res_scale}
            if bicubic_skip:
                # start exactly at bicubic: the residual head outputs mean, which the skip subtracts
                torch.nn.init.zeros_(self.edsr.conv_last.weight)
                torch.nn.init.zeros_(self.edsr.conv_last.bias)

        def forward(self, x):  # x: (N, 3, h, w) RGB in [0, 1]
            y = self.edsr(x)
            if not self.bicubic_skip:
                return y
            up = torch.nn.functional.interpolate(x, scale_factor=self.upscale, mode="bicubic", align_corners=False)
            return up + (y - self.edsr.mean)

    return SRNet()


def save_checkpoint(model: Any, path: str | Path, extra: dict[str, Any] | None = None, half: bool = True) -> None:
    """basicsr layout (``params``) plus ``osvl`` metadata; fp16 storage halves the committed file."""
    torch = _torch()
    state = model.edsr.state_dict()
    params = {k: (v.half() if half and v.is_floating_point() else v).clone() for k, v in state.items()}
    torch.save({"params": params, "osvl": {**model.meta, **(extra or {})}}, str(path))


def _infer_meta(params: dict[str, Any]) -> dict[str, Any]:
    """Architecture of a checkpoint without ``osvl`` metadata (an official basicsr one), from tensor shapes."""
    num_feat = params["conv_first.weight"].shape[0]
    num_block = len({k.split(".")[1] for k in params if k.startswith("body.")})
    ups = [params[k].shape[0] // num_feat for k in params if k.startswith("upsample.") and k.endswith(".weight")]
    upscale = 3 if ups == [9] else 2 ** len(ups)
    # basicsr's official EDSR_L (f256 b32) is trained with res_scale 0.1, the M models with 1
    return {"num_feat": num_feat, "num_block": num_block, "upscale": upscale, "bicubic_skip": False,
            "res_scale": 0.1 if num_feat == 256 else 1.0}


def edsr_device(cuda_available: bool | None = None, ray_gpu_ids: list[Any] | None = None) -> str:
    """``"cuda"`` or ``"cpu"`` for an EDSR model (see the module docstring); arguments default to this process.

    ``ray_gpu_ids``: the GPUs Ray assigned this worker (``ray.get_gpu_ids()``), ``None`` outside a Ray worker.
    """
    if cuda_available is None:
        cuda_available = _torch().cuda.is_available()
    if ray_gpu_ids is None:
        ray_gpu_ids = _ray_gpu_ids()
    if not cuda_available:
        return "cpu"
    return "cpu" if ray_gpu_ids is not None and not ray_gpu_ids else "cuda"


def _ray_gpu_ids() -> list[Any] | None:
    """GPUs Ray assigned to this worker process; ``None`` when this is not a Ray worker (or the driver)."""
    if "ray" not in sys.modules:  # never import Ray (seconds, and absent on the GPU check machine) to ask
        return None
    import ray  # noqa: PLC0415 (d) keeps ray out of jobs/ask.py --help

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return list(ray.get_gpu_ids())


def load_model(path: str | Path = DEFAULT_WEIGHTS, device: str | None = None) -> Any:
    """Load an osvl or official basicsr EDSR checkpoint as an eval-mode ``SRNet`` on ``device``.

    ``device`` defaults to ``edsr_device()``; on CUDA the weights are cast to float16, else float32.
    """
    torch = _torch()
    path = Path(path)
    if not path.is_file():
        raise WeightsMissingError(
            f"EDSR weights not found at {path}; train them with `python jobs/train_edsr.py` "
            f"or place an official basicsr EDSR checkpoint there (see osvl/tools/weights/README.md)")
    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one kind of failure for the caller
        raise ModelLoadError(f"{path}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    key = "params_ema" if "params_ema" in ckpt else "params" if "params" in ckpt else None
    if key is None:
        raise ModelLoadError(f"{path}: expected a basicsr checkpoint with 'params' or 'params_ema', "
                             f"got keys {sorted(ckpt)[:5]}")
    params = ckpt[key]
    meta = ckpt.get("osvl") or _infer_meta(params)
    arch = {k: meta[k] for k in ("num_feat", "num_block", "upscale", "bicubic_skip", "res_scale")}
    model = build_model(**arch)
    try:
        model.edsr.load_state_dict({k: v.float() for k, v in params.items()})
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: weights do not fit basicsr EDSR {arch}: {e}") from None
    model.meta = dict(meta)
    device = device or edsr_device()
    return model.to(device=device, dtype=torch.float16 if device.startswith("cuda") else torch.float32).eval()


def upscale_batch(model: Any, images: list[np.ndarray], max_input_pixels: int = MAX_INPUT_PIXELS) -> list[np.ndarray]:
    """One forward pass over same-size uint8 RGB images (what a Serve ``@serve.batch`` handler calls)."""
    torch = _torch()
    if not images:
        return []
    shape = images[0].shape
    if any(im.shape != shape for im in images):
        raise InvalidCall(f"a batch must hold images of one size, got {sorted({im.shape for im in images})}")
    if shape[0] * shape[1] > max_input_pixels:
        raise InvalidCall(f"super_resolution input {shape[1]}x{shape[0]} exceeds {max_input_pixels} pixels; "
                          f"crop the region of interest first", limit=True)
    param = next(model.parameters())
    x = torch.from_numpy(np.stack(images)).to(param.device).permute(0, 3, 1, 2).to(param.dtype).div_(255.0)
    with torch.inference_mode():
        out = model(x).float().clamp_(0, 1).mul_(255.0).round_().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [np.ascontiguousarray(o) for o in out]


# ---------------------------------------------------------------------------
# the evaluation protocol (shared by the training job, the tests and the Serve checks)


def modcrop(img: np.ndarray, scale: int) -> np.ndarray:
    h, w = img.shape[:2]
    return img[: h - h % scale, : w - w % scale]


def make_lr(hr: np.ndarray, scale: int = 4) -> np.ndarray:
    """Bicubic (antialiased, PIL) downscale of a modcropped uint8 image: the standard SR degradation."""
    h, w = hr.shape[:2]
    return np.asarray(Image.fromarray(hr).resize((w // scale, h // scale), Image.BICUBIC))


def bicubic_upscale(lr: np.ndarray, scale: int = 4) -> np.ndarray:
    """The baseline: the same bicubic upsample the skip connection uses, rounded to uint8."""
    torch = _torch()
    x = torch.from_numpy(np.array(lr)).permute(2, 0, 1)[None].float() / 255.0  # copy: PIL arrays are read-only
    y = torch.nn.functional.interpolate(x, scale_factor=scale, mode="bicubic", align_corners=False)
    return y.clamp(0, 1).mul(255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()


def psnr_y(a: np.ndarray, b: np.ndarray, shave: int = 4) -> float:
    """PSNR on the BT.601 luma (Y of YCbCr, 16..235) with ``shave`` border pixels removed: the SR convention."""
    if a.shape != b.shape:
        raise ValueError(f"psnr_y: shapes differ {a.shape} vs {b.shape}")
    w = np.array([65.481, 128.553, 24.966]) / 255.0
    ya = a.astype(np.float64) @ w + 16.0
    yb = b.astype(np.float64) @ w + 16.0
    if shave:
        ya, yb = ya[shave:-shave, shave:-shave], yb[shave:-shave, shave:-shave]
    mse = float(np.mean((ya - yb) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def evaluate(model: Any, images: dict[str, np.ndarray], scale: int = 4) -> list[dict[str, Any]]:
    """Per image: PSNR-Y of bicubic and of the model on the bicubic-downscaled HR image."""
    rows = []
    for name, img in images.items():
        hr = modcrop(img, scale)
        lr = make_lr(hr, scale)
        (sr,) = upscale_batch(model, [lr], max_input_pixels=lr.shape[0] * lr.shape[1])
        rows.append({"image": name, "bicubic": round(psnr_y(bicubic_upscale(lr, scale), hr, scale), 3),
                     "edsr": round(psnr_y(sr, hr, scale), 3)})
    return rows


def read_rgb(path: str | Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


# ---------------------------------------------------------------------------
# the tool


@cache
def _default_model(path: str) -> Any:
    return load_model(path)


def super_resolution(ctx: ToolContext, image: Any = None, scale: Any = 4) -> ToolResult:
    img = ctx.image(image)
    s = number({"scale": scale}, "scale", lo=2, hi=4, integer=True)
    model = ctx.options.get("edsr")
    try:
        if model is None:
            model = _default_model(str(ctx.options.get("edsr_weights", DEFAULT_WEIGHTS)))
    except (WeightsMissingError, DependencyMissingError) as e:
        return ToolResult.fail("unavailable", f"super_resolution: {e}")
    if s != model.upscale:
        raise InvalidCall(f"scale {s} is not available; the loaded EDSR upscales x{model.upscale}")
    h, w = img.shape[:2]
    if h * w * s * s > ctx.max_pixels:
        raise InvalidCall(f"output {w * s}x{h * s} would exceed the limit of {ctx.max_pixels} pixels", limit=True)
    (out,) = upscale_batch(model, [img])
    name = ctx.next_name()
    return ToolResult("ok", f"Upscaled {image} x{s} to {out.shape[1]}x{out.shape[0]} as {name}.",
                      images={name: out})


register(Tool(
    name="super_resolution",
    description="Upscale an image with the EDSR super-resolution network to recover fine detail "
                "(small text, distant objects). Crop the region of interest first: inputs are capped.",
    parameters={
        "type": "object",
        "properties": {
            "image": IMAGE_ARG,
            "scale": {"type": "integer", "description": "Upscaling factor (the default weights do 4).",
                      "default": 4},
        },
        "required": ["image"],
    },
    fn=super_resolution,
    backend="edsr",
    version="1",
))
