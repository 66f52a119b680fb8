"""Schemathesis hooks for ``tests/test_serve_openapi.py`` (loaded through ``SCHEMATHESIS_HOOKS``).

A fuzzer cannot make PNG files out of random bytes, so without help every positive call to an
image tool is refused for its image and says nothing about the arguments. This hook replaces
the images of each positive call (JSON or multipart) with real ones under the same names, plus one
under the name the ``image`` argument refers to. On the generic route ``/v1/tools/{name}`` it also names
the tool whose schema the generated arguments fit: the one dependency (path parameter to body)
an OpenAPI document cannot state. Everything else (argument values, the negative cases) stays
as generated.
"""

from __future__ import annotations

import base64

import numpy as np
import schemathesis

from osvl.tools.client import PART_NAME, encode_image

_ramp = np.linspace(0, 255, 48)
PHOTO = encode_image(np.stack([np.add.outer(_ramp, _ramp) / 2, np.add.outer(_ramp, -_ramp) / 2 + 128,
                               np.full((48, 48), 90.0)], axis=-1).astype(np.uint8))
PHOTO_BYTES = base64.b64decode(PHOTO)


@schemathesis.hook
def map_case(context, case):
    from schemathesis.generation.modes import GenerationMode

    body = case.body
    positive = case.meta is None or case.meta.generation.mode == GenerationMode.POSITIVE
    if not (positive and isinstance(body, dict) and isinstance(body.get("arguments"), dict)):
        return case
    ref = body["arguments"].get("image")
    if case.media_type == "application/json" and isinstance(body.get("images", {}), dict):
        names = set(body.get("images", {})) | ({ref} if isinstance(ref, str) else set())
        if names:
            body["images"] = {name: PHOTO for name in names}
    elif case.media_type == "multipart/form-data":
        # every part but these two is an image (its bytes decide, whatever it declares); the image argument must
        # name one, and a part's name is a token: an empty or odd generated reference becomes img_1
        names = set(body) - {"arguments", "new_image_name"}
        if isinstance(ref, str):
            if not PART_NAME.fullmatch(ref):
                ref = body["arguments"]["image"] = "img_1"
            names.add(ref)
        for name in names:
            body[name] = PHOTO_BYTES
    if "name" in (case.path_parameters or {}):
        deployed = case.operation.definition.raw["parameters"][0]["schema"]["enum"]
        case.path_parameters["name"] = _tool_for(body["arguments"], deployed, case.path_parameters["name"])
    return case


def _tool_for(arguments: dict, deployed: list[str], default: str) -> str:
    from osvl.tools.registry import all_tools

    tools = all_tools()
    for name in deployed:
        tool = tools[name]
        props, required = tool.parameters.get("properties", {}), tool.parameters.get("required", [])
        if set(arguments) <= set(props) and set(required) <= set(arguments):
            return name
    return default
