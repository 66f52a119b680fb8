"""Image degradation: the reason the agent's restoration tools exist.

A configurable share of questions gets its image blurred, downsampled or
perspective-warped, and the row records the parameters and the tool that undoes
each one (``sharpen``, ``super_resolution``, ``perspective_correct``), so a
trajectory that calls the right tool can be rewarded and the degradation can be
reproduced exactly. Strengths are drawn from ranges where the image stays
recognisable after the undo but not trivially before it.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

from osvl.errors import ConfigError

UNDO_TOOL = {"blur": "sharpen", "downsample": "super_resolution", "perspective": "perspective_correct"}


def blur(image: np.ndarray, sigma: float) -> np.ndarray:
    return cv2.GaussianBlur(image, (0, 0), sigmaX=sigma, sigmaY=sigma)


def downsample(image: np.ndarray, factor: int) -> np.ndarray:
    """Keep the small image (no re-upscale): super-resolution is what restores the pixels."""
    h, w = image.shape[:2]
    return cv2.resize(image, (max(1, w // factor), max(1, h // factor)), interpolation=cv2.INTER_AREA)


def perspective(image: np.ndarray, corners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Warp the full frame onto ``corners`` (TL, TR, BR, BL); returns the image and the 3x3 homography."""
    h, w = image.shape[:2]
    src = np.float32([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]])
    matrix = cv2.getPerspectiveTransform(src, np.float32(corners))
    warped = cv2.warpPerspective(image, matrix, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    return warped, matrix


def degrade(image: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
    """Apply one degradation with parameters drawn from ``rng``; returns (image, record for the row)."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 RGB image (H, W, 3), got {image.dtype} {image.shape}")
    h, w = image.shape[:2]
    if kind == "blur":
        sigma = round(float(rng.uniform(2.0, 4.0)), 2)
        out, params = blur(image, sigma), {"sigma": sigma}
    elif kind == "downsample":
        factor = int(rng.integers(3, 5))
        out, params = downsample(image, factor), {"factor": factor, "original_size": [w, h]}
    elif kind == "perspective":
        jitter = rng.uniform(0.05, 0.18, size=(4, 2)) * np.array([w, h])
        signs = np.array([[1, 1], [-1, 1], [-1, -1], [1, -1]])  # pull each corner inwards
        base = np.array([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]], dtype=float)
        corners = np.round(base + signs * jitter, 1)
        out, matrix = perspective(image, corners)
        params = {"corners": corners.tolist(), "homography": np.round(matrix, 8).tolist()}
    else:
        raise ConfigError(f"unknown degradation {kind!r}; choose from {sorted(UNDO_TOOL)}")
    return out, {"kind": kind, "undo_tool": UNDO_TOOL[kind], **params}
