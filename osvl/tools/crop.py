"""``crop(image, x, y, width, height)``: a rectangle in the image's own absolute pixels (OpenSearch-VL schema).

Out-of-bounds rectangles are rejected (``invalid_call``), not clamped: a clamped
crop silently shows the agent a different region than it asked for, and the
HTTP bad-input suite expects "crop out of bounds" to be a typed 4xx error. The
error message states the image size so the next call can be corrected.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from osvl.tools.base import IMAGE_ARG, InvalidCall, Tool, ToolContext, ToolResult, number, register


def crop(ctx: ToolContext, image: Any = None, x: Any = None, y: Any = None, width: Any = None,
         height: Any = None) -> ToolResult:
    img = ctx.image(image)
    h, w = img.shape[:2]
    args = {"x": x, "y": y, "width": width, "height": height}
    x0 = number(args, "x", lo=0, integer=True)
    y0 = number(args, "y", lo=0, integer=True)
    cw = number(args, "width", lo=1, integer=True)
    ch = number(args, "height", lo=1, integer=True)
    if x0 + cw > w or y0 + ch > h:
        raise InvalidCall(f"crop out of bounds: x={x0}, y={y0}, width={cw}, height={ch} does not fit in "
                          f"{image} of size {w}x{h} (need x+width <= {w} and y+height <= {h})")
    out = np.ascontiguousarray(img[y0:y0 + ch, x0:x0 + cw])
    name = ctx.next_name()
    return ToolResult("ok", f"Cropped {image} to {cw}x{ch} as {name}.", images={name: out})


register(Tool(
    name="crop",
    description="Crop a rectangle out of an image to look at a region more closely. "
                "Coordinates are absolute pixels of that image; (x, y) is the top-left corner.",
    parameters={
        "type": "object",
        "properties": {
            "image": IMAGE_ARG,
            "x": {"type": "integer", "minimum": 0, "description": "Left edge in pixels."},
            "y": {"type": "integer", "minimum": 0, "description": "Top edge in pixels."},
            "width": {"type": "integer", "minimum": 1, "description": "Width in pixels."},
            "height": {"type": "integer", "minimum": 1, "description": "Height in pixels."},
        },
        "required": ["image", "x", "y", "width", "height"],
    },
    fn=crop,
    backend="local",
    version="1",
))
