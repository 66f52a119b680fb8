"""``perspective_correct(image)``: find the largest four-cornered outline (a page, a sign, a screen) and warp it flat.

The classic document-scanner pipeline: grey, blur, Canny edges closed by a
dilation, external contours by area, and the first one whose polygon
approximation has four convex corners and covers at least ``MIN_AREA_FRACTION``
of the image. The corners are refined to sub-pixel accuracy by intersecting
straight lines fitted to the contour points along each side (the polygon
approximation alone snaps to contour pixels, which the dilation pushes outwards).
The output rectangle takes the longer of each pair of opposite sides.

Finding no quadrilateral is a normal outcome for a photo without a page in it:
an ``ok`` result saying so, with no new image, not a failure.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from osvl.tools.base import IMAGE_ARG, Tool, ToolContext, ToolResult, register

MIN_AREA_FRACTION = 0.1
"""Smaller quadrilaterals are usually text boxes or windows, not the page the agent wants flattened."""
FRAME_TOLERANCE = 0.03
"""A quadrilateral whose corners all lie within this share of the diagonal from the image's corners is the
frame itself (a bordered scan, or texture whose edges merge into one blob): flattening it changes nothing."""


def order_corners(pts: np.ndarray) -> np.ndarray:
    """(4, 2) points as top-left, top-right, bottom-right, bottom-left (by angle around the centroid)."""
    c = pts.mean(axis=0)
    ang = np.arctan2(pts[:, 1] - c[1], pts[:, 0] - c[0])
    p = pts[np.argsort(ang)]  # clockwise in image coordinates (y down), starting near the left
    start = int(np.argmin(p.sum(axis=1)))  # top-left has the smallest x + y
    return np.roll(p, -start, axis=0).astype(np.float64)


def _refine(contour: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """Fit a line to the contour points of each side (away from the corners) and intersect neighbours."""
    import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

    pts = contour.reshape(-1, 2).astype(np.float64)
    lines = []
    for i in range(4):
        a, b = corners[i], corners[(i + 1) % 4]
        d = b - a
        length = float(np.hypot(*d))
        t = (pts - a) @ d / length**2  # position along the side
        dist = np.abs((pts - a) @ np.array([-d[1], d[0]]) / length)
        side = pts[(t > 0.1) & (t < 0.9) & (dist < max(3.0, 0.02 * length))]
        if len(side) < 5:
            return corners
        vx, vy, x0, y0 = cv2.fitLine(side.astype(np.float32), cv2.DIST_HUBER, 0, 0.01, 0.01).ravel()
        lines.append((np.array([x0, y0], np.float64), np.array([vx, vy], np.float64)))
    out = np.empty_like(corners)
    for i in range(4):  # corner i lies between side i-1 and side i
        (p1, v1), (p2, v2) = lines[i - 1], lines[i]
        m = np.array([v1, -v2]).T
        if abs(np.linalg.det(m)) < 1e-9:
            return corners
        s = np.linalg.solve(m, p2 - p1)[0]
        out[i] = p1 + s * v1
    if np.max(np.hypot(*(out - corners).T)) > 0.05 * np.hypot(*(corners[2] - corners[0])):
        return corners  # a bad fit; keep the polygon corners
    return out


def find_quad(img: np.ndarray) -> np.ndarray | None:
    """Corners (tl, tr, br, bl) of the largest convex quadrilateral outline, or None."""
    import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

    gray = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
    gray = cv2.GaussianBlur(gray, (5, 5), 0)
    edges = cv2.Canny(gray, 50, 150)
    edges = cv2.dilate(edges, np.ones((3, 3), np.uint8))
    contours, _ = cv2.findContours(edges, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    h, w = img.shape[:2]
    min_area = MIN_AREA_FRACTION * h * w
    frame = np.array([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]], np.float64)
    for c in sorted(contours, key=cv2.contourArea, reverse=True)[:10]:
        if cv2.contourArea(c) < min_area:
            break
        approx = cv2.approxPolyDP(c, 0.02 * cv2.arcLength(c, True), True)
        if len(approx) != 4 or not cv2.isContourConvex(approx):
            continue
        corners = order_corners(approx.reshape(4, 2))
        if np.hypot(*(corners - frame).T).max() > FRAME_TOLERANCE * np.hypot(h, w):
            return _refine(c, corners)
    return None


def warp_quad(img: np.ndarray, corners: np.ndarray) -> np.ndarray:
    import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

    tl, tr, br, bl = corners
    w = int(round(max(np.hypot(*(tr - tl)), np.hypot(*(br - bl)))))
    h = int(round(max(np.hypot(*(bl - tl)), np.hypot(*(br - tr)))))
    dst = np.array([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]], np.float32)
    m = cv2.getPerspectiveTransform(corners.astype(np.float32), dst)
    return cv2.warpPerspective(img, m, (w, h), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)


def perspective_correct(ctx: ToolContext, image: Any = None) -> ToolResult:
    img = ctx.image(image)
    corners = find_quad(img)
    if corners is None:
        return ToolResult("ok", f"No quadrilateral found in {image}; nothing to correct.",
                          data={"corners": None})
    out = warp_quad(img, corners)
    name = ctx.next_name()
    pts = ", ".join(f"({x:.0f}, {y:.0f})" for x, y in corners)
    return ToolResult("ok", f"Corrected the perspective of the quadrilateral at {pts} in {image}; "
                            f"the flattened {out.shape[1]}x{out.shape[0]} view is {name}.",
                      images={name: out}, data={"corners": corners.round(2).tolist()})


register(Tool(
    name="perspective_correct",
    description="Find the largest four-cornered outline in an image (a page, sign or screen photographed "
                "at an angle) and warp it to a flat, front-on rectangle.",
    parameters={
        "type": "object",
        "properties": {"image": IMAGE_ARG},
        "required": ["image"],
    },
    fn=perspective_correct,
    backend="local",
    version="1",
))
