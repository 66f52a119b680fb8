"""Image tools through the real tool contract: crop, sharpen, perspective_correct, ocr, the registry."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from osvl.errors import DependencyMissingError
from osvl.tools.base import REGISTRY, ToolContext, call_tool
from osvl.tools.registry import all_tools

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


def _font_path() -> Path:
    if FONT.is_file():
        return FONT
    import matplotlib  # ships DejaVuSans.ttf when the Debian font is absent

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"


def _photo(shared_data: Path, name: str = "messi5.jpg") -> np.ndarray:
    from osvl.tools.super_resolution import read_rgb

    return read_rgb(shared_data / "images" / "opencv" / name)


def _call(name: str, args, images: dict) -> object:
    return call_tool(REGISTRY[name], args, ToolContext(images=images))


# ---------------------------------------------------------------------------
# registry and schemas


def test_registry_has_every_image_tool_with_consistent_schema():
    tools = all_tools()
    for name in ("crop", "sharpen", "super_resolution", "perspective_correct", "ocr"):
        t = tools[name]
        props = t.parameters["properties"]
        assert set(t.parameters["required"]) <= set(props)
        assert props["image"]["type"] == "string"
        assert t.schema["function"]["name"] == name


def test_import_registry_is_light():
    code = ("import sys, osvl.tools.registry\n"
            "print(','.join(m for m in ('torch', 'cv2', 'scipy', 'rapidocr', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------
# crop


def test_crop_is_exact_and_names_the_new_image():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
    r = _call("crop", {"image": "img_1", "x": 10, "y": 20, "width": 150, "height": 100}, {"img_1": img})
    assert r.ok, r.text
    assert r.text == "Cropped img_1 to 150x100 as img_2."
    np.testing.assert_array_equal(r.images["img_2"], img[20:120, 10:160])
    full = _call("crop", {"image": "img_1", "x": 0, "y": 0, "width": 200, "height": 120}, {"img_1": img})
    np.testing.assert_array_equal(full.images["img_2"], img)


@pytest.mark.parametrize("args, needle", [
    ({"x": 100, "y": 0, "width": 101, "height": 10}, "out of bounds"),
    ({"x": 0, "y": 50, "width": 10, "height": 71}, "out of bounds"),
    ({"x": -1, "y": 0, "width": 10, "height": 10}, "x must be in"),
    ({"x": 0, "y": 0, "width": 0, "height": 10}, "width must be in"),
    ({"x": float("nan"), "y": 0, "width": 10, "height": 10}, "finite"),
    ({"x": "3", "y": 0, "width": 10, "height": 10}, "must be a number"),
    ({"x": True, "y": 0, "width": 10, "height": 10}, "must be a number"),
    ({"x": 1.5, "y": 0, "width": 10, "height": 10}, "integer"),
    ({"x": 0, "y": 0, "width": 10}, "missing required"),
    ({"x": 0, "y": 0, "width": 10, "height": 10, "zoom": 2}, "unknown argument"),
])
def test_crop_bad_arguments_are_invalid_call(args, needle):
    img = np.zeros((120, 200, 3), np.uint8)
    r = _call("crop", {"image": "img_1", **args}, {"img_1": img})
    assert r.status == "error" and r.error.kind == "invalid_call"
    assert needle in r.error.message
    assert not r.images


@pytest.mark.parametrize("tool", ["crop", "sharpen", "perspective_correct", "ocr", "super_resolution"])
def test_unknown_or_malformed_image_reference_is_invalid_call(tool):
    extra = {"x": 0, "y": 0, "width": 1, "height": 1} if tool == "crop" else {}
    img = np.zeros((8, 8, 3), np.uint8)
    r = _call(tool, {"image": "img_7", **extra}, {"img_1": img})
    assert r.error.kind == "invalid_call" and "no image named 'img_7'" in r.error.message
    r = _call(tool, {"image": 1, **extra}, {"img_1": img})
    assert r.error.kind == "invalid_call"
    r = _call(tool, {"image": "img_1", **extra}, {"img_1": np.zeros((8, 8), np.float32)})
    assert r.error.kind == "invalid_call" and "RGB uint8" in r.error.message


# ---------------------------------------------------------------------------
# sharpen


@pytest.mark.parametrize("amount, sigma", [(1.5, 3), (0.5, 1.0), (3.0, 0.7), (2.0, 6.5)])
def test_sharpen_matches_scipy_float64_reference(shared_data, amount, sigma):
    from osvl.tools.sharpen import unsharp_reference

    img = _photo(shared_data)
    r = _call("sharpen", {"image": "img_1", "amount": amount, "sigma": sigma}, {"img_1": img})
    assert r.ok, r.text
    out = r.images["img_2"]
    ref = unsharp_reference(img, amount, sigma)
    b = int(4 * sigma + 0.5)  # interior: beyond the kernel radius from every border
    diff = np.abs(out.astype(int) - ref)[b:-b, b:-b]
    assert diff.max() <= 1
    # and it really sharpens: more high-frequency energy than the input
    lap = lambda a: np.abs(np.diff(a.astype(float), 2, axis=1)).mean()  # noqa: E731
    assert lap(out) > lap(img) * (1 + 0.2 * amount)


def test_sharpen_defaults_and_bad_values():
    from osvl.tools.sharpen import unsharp_reference

    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)
    r = _call("sharpen", {"image": "img_1"}, {"img_1": img})
    assert r.text == "Sharpened img_1 (amount 1.5, sigma 3) as img_2."
    assert np.abs(r.images["img_2"][13:-13, 13:-13].astype(int) - unsharp_reference(img)[13:-13, 13:-13]).max() <= 1
    for args in ({"amount": -1}, {"amount": math.inf}, {"sigma": 0}, {"sigma": "big"}, {"amount": None}):
        r = _call("sharpen", {"image": "img_1", **args}, {"img_1": img})
        assert r.error.kind == "invalid_call", args


# ---------------------------------------------------------------------------
# perspective_correct


def _document(w: int = 420, h: int = 560) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", (w, h), (250, 248, 240))
    d = ImageDraw.Draw(im)
    font = ImageFont.truetype(str(_font_path()), 18)
    for i in range(14):
        d.text((30, 30 + 36 * i), f"Line {i} of a rendered document page", fill=(20, 20, 20), font=font)
    return np.asarray(im)


def _photographed(doc: np.ndarray, corners, size=(900, 800), seed: int = 0) -> np.ndarray:
    """``doc`` warped by the homography that sends its rectangle to ``corners``, over a noisy background."""
    import cv2

    rng = np.random.default_rng(seed)
    w, h = size
    bg = cv2.GaussianBlur(rng.normal(90, 25, (h, w, 3)).clip(0, 255).astype(np.uint8), (7, 7), 0)
    dh, dw = doc.shape[:2]
    m = cv2.getPerspectiveTransform(np.float32([[0, 0], [dw, 0], [dw, dh], [0, dh]]), np.float32(corners))
    warped = cv2.warpPerspective(doc, m, size, flags=cv2.INTER_CUBIC)
    mask = cv2.warpPerspective(np.full((dh, dw), 255, np.uint8), m, size) > 127
    bg[mask] = warped[mask]
    return bg


@pytest.mark.parametrize("corners", [
    [[150, 100], [620, 160], [700, 720], [90, 650]],
    [[300, 80], [800, 200], [650, 760], [120, 600]],
    [[100, 100], [500, 100], [500, 640], [100, 640]],
])
def test_perspective_recovers_document_corners_within_one_percent(corners):
    """Corner error: distance between the detected corners (``data["corners"]``, tl/tr/br/bl in input pixels)
    and the true corners of the warped document rectangle, over the input image diagonal."""
    import cv2

    doc = _document()
    img = _photographed(doc, corners)
    r = _call("perspective_correct", {"image": "img_1"}, {"img_1": img})
    assert r.ok and "img_2" in r.images, r.text
    found = np.array(r.data["corners"])
    err = np.hypot(*(found - np.array(corners, float)).T)
    assert err.max() <= 0.01 * math.hypot(*img.shape[:2]), err
    # the flattened view shows the page: its grey levels, lightly blurred (so a 1-pixel shift of thin text
    # does not count), correlate with the original page (the warped input's bounding box scores below 0)
    flat = cv2.resize(r.images["img_2"], (doc.shape[1], doc.shape[0]), interpolation=cv2.INTER_AREA)

    def grey(a):
        return cv2.GaussianBlur(cv2.cvtColor(a, cv2.COLOR_RGB2GRAY).astype(np.float32), (0, 0), 2).ravel()

    assert np.corrcoef(grey(flat), grey(doc))[0, 1] > 0.85


def test_perspective_without_quadrilateral_is_ok_without_image():
    import cv2

    rng = np.random.default_rng(3)
    img = cv2.GaussianBlur(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8), (31, 31), 0)
    r = _call("perspective_correct", {"image": "img_1"}, {"img_1": img})
    assert r.ok and not r.images
    assert r.text.startswith("No quadrilateral found")


# ---------------------------------------------------------------------------
# ocr

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."

IMAGE_TEXT_N = """technical details are too complex to cover in the book itself.
In teaching our courses, we have found it useful for the students to attempt a number of
small implementation projects, which often build on one another, in order to get them used to
working with real-world images and the challenges that these present. The students are then
asked to choose an individual topic for each of their small-group, final projects. (Sometimes
these projects even turn into conference papers!) The exercises at the end of each chapter
contain numerous suggestions for smaller mid-term projects, as well as more open-ended
problems whose solutions are still active research topics. Wherever possible, I encourage
students to try their algorithms on their own personal photographs, since this better motivates
them, often leads to creative variants on the problems, and better acquaints them with the
variety and complexity of real-world imagery.
In formulating and solving computer vision problems, I have often found it useful to draw
inspiration from three high-level approaches:"""


def _rendered_sentence() -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(_font_path()), 32)
    x0, y0, x1, y1 = font.getbbox(SENTENCE)
    im = Image.new("RGB", (x1 + 40, y1 + 40), "white")
    ImageDraw.Draw(im).text((20, 20), SENTENCE, fill="black", font=font)
    return np.asarray(im)


def test_metrics_are_right_on_known_strings():
    from osvl.tools.ocr import char_error_rate, word_recall

    assert char_error_rate("kitten", "sitting") == pytest.approx(3 / 7)
    assert char_error_rate("a  b\nc", "a b c") == 0
    assert word_recall("the cat, the", "The the cat dog") == 0.75


@pytest.mark.slow
def test_ocr_rendered_sentence_cer_at_most_10_percent():
    from osvl.tools.ocr import char_error_rate

    img = _rendered_sentence()
    r = _call("ocr", {"image": "img_1"}, {"img_1": img})
    assert r.ok and not r.images
    assert r.text.startswith("Found 1 text block(s) in img_1:\n[x=")
    cer = char_error_rate(r.data["text"], SENTENCE)
    assert cer <= 0.10, (cer, r.data["text"])
    (block,) = r.data["blocks"]
    xs = [p[0] for p in block["box"]]
    assert min(xs) < 40 and max(xs) > img.shape[1] - 60  # the box spans the sentence


@pytest.mark.slow
def test_ocr_reads_80_percent_of_image_text_n_words(shared_data):
    from osvl.tools.ocr import word_recall

    r = _call("ocr", {"image": "img_1"}, {"img_1": _photo(shared_data, "imageTextN.png")})
    assert r.ok
    assert word_recall(r.data["text"], IMAGE_TEXT_N) >= 0.8
    assert len(r.data["blocks"]) >= 10


@pytest.mark.slow
def test_ocr_batch_returns_one_result_per_image_and_blank_is_empty():
    from osvl.tools.ocr import full_text, ocr_batch

    blank = np.full((64, 256, 3), 255, np.uint8)
    out = ocr_batch([_rendered_sentence(), blank])
    assert len(out) == 2 and out[1] == []
    assert "fox" in full_text(out[0])
    r = _call("ocr", {"image": "img_1"}, {"img_1": blank})
    assert r.ok and r.text == "No text found in img_1."


def test_ocr_tesseract_missing_binary_is_dependency_missing():
    from osvl.tools.ocr import ocr_batch

    with pytest.raises(DependencyMissingError, match="apt-get install -y tesseract-ocr"):
        ocr_batch([np.zeros((8, 8, 3), np.uint8)], "tesseract", cmd="tesseract-not-installed-here")
    ctx = ToolContext(images={"img_1": np.zeros((8, 8, 3), np.uint8)}, options={
        "ocr_backend": "tesseract", "ocr_backend_options": {"cmd": "tesseract-not-installed-here"}})
    r = call_tool(REGISTRY["ocr"], {"image": "img_1"}, ctx)
    assert r.error.kind == "unavailable" and "tesseract-ocr" in r.error.message
    r = call_tool(REGISTRY["ocr"], {"image": "img_1"}, ToolContext(images=ctx.images, options={"ocr_backend": "x"}))
    assert r.error.kind == "invalid_call"


@pytest.mark.slow
def test_ocr_tesseract_backend_reads_the_sentence(tesseract):
    """The backend as configured (``ocr_backend: tesseract``, the binary found on PATH) end to end."""
    from osvl.tools.ocr import char_error_rate

    ctx = ToolContext(images={"img_1": _rendered_sentence()}, options={"ocr_backend": "tesseract"})
    r = call_tool(REGISTRY["ocr"], {"image": "img_1"}, ctx)
    assert r.ok, r.text
    assert char_error_rate(r.data["text"], SENTENCE) <= 0.10


def test_perspective_on_real_photos(shared_data):
    """sudoku.png: the square grid photographed at an angle comes back near-square; box.png (textured
    scene, no page) gives no quadrilateral rather than its own frame."""
    r = _call("perspective_correct", {"image": "img_1"}, {"img_1": _photo(shared_data, "sudoku.png")})
    assert r.ok and "img_2" in r.images
    h, w = r.images["img_2"].shape[:2]
    assert 0.9 < w / h < 1.1 and min(h, w) > 400
    r = _call("perspective_correct", {"image": "img_1"}, {"img_1": _photo(shared_data, "box.png")})
    assert r.ok and not r.images and r.data["corners"] is None
