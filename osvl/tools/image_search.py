"""``image_search(image, top_k)``: reverse image search over the KG's grounded photos.

Offline backend: ORB local features, brute-force Hamming matching with Lowe's ratio
test, then geometric verification (a RANSAC similarity transform) of the few images that
collected the most votes; the score is the number of inliers. Why local features and
not a perceptual hash: the agent searches with crops (50-90 % of the area), blurred,
downscaled and recompressed copies. A global hash of a crop is a different hash, while
the keypoints inside the crop still match the original and still agree on one
similarity transform. Why ORB and not SIFT: binary descriptors match 10x cheaper and
the index stays small (32 bytes a keypoint); the acceptance test (300 degraded queries
over 250 photos) is >= 0.99 top-1 with ORB already.

Small queries (a 0.3x downscaled crop of a 320 px photo is ~80 px) have no keypoints at
ORB's default 31 px patch, so every image is upscaled to at least ``min_side`` before
detection and downscaled to at most ``max_side``; the index images get the same
treatment, so scales meet within ORB's pyramid.

The result is a text listing (title, page snippet, match strength) without
thumbnails: the agent already holds the query image, and a thumbnail of the match costs
hundreds of vision tokens per call while adding nothing the title does not say for the
next step (a text search on the name). The snippet is what a search engine shows under an
image match: the page's description and the opening of its text, cut to ``snippet_chars``.
``data["hits"]`` carries the index image names for callers that want to show them.

Backends are pluggable: the tool calls the object in ``ctx.options["image_search"]``, any with
``backend_id`` and ``search(image, top_k) -> list[ImageHit]``, and has no default of its own
(``osvl.agent.env.build_env`` passes the index of ``ImageSearchConfig``'s KG, built once and
cached on disk by content hash; a call without one fails as a ``tool_error``).
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from osvl.config import opt
from osvl.errors import DataError
from osvl.kg.schema import SAMPLE_DIR
from osvl.storage import atomic_write
from osvl.tools.base import IMAGE_ARG, Tool, ToolContext, ToolResult, number, option_backend, register
from osvl.tools.cache import file_digest, store_root

INDEX_VERSION = 2  # 2: hits carry a page snippet (description + opening text), not the description alone


@dataclasses.dataclass
class ImageSearchConfig:
    kg_dir: str = opt("", "KG folder whose anchors.parquet photos are indexed; empty = the committed sample.")
    features: int = opt(500, "ORB keypoints per image (index and query).")
    max_side: int = opt(512, "Images are downscaled to at most this many pixels on the long side.")
    min_side: int = opt(320, "Images are upscaled to at least this long side (small crops have no keypoints).")
    ratio: float = opt(0.8, "Lowe's ratio test: best match must be this much closer than the second best.")
    verify: int = opt(8, "This many most-voted index images are verified geometrically.")
    min_inliers: int = opt(8, "Fewer RANSAC inliers than this is no match.")
    snippet_chars: int = opt(300, "Characters of page snippet shown per hit (the description, then the opening "
                                  "of the article).")


@dataclass
class ImageHit:
    title: str
    snippet: str
    score: float  # RANSAC inliers (offline) or the backend's own relevance
    image: str = ""  # the index image that matched


class ImageIndex:
    """ORB keypoints of every indexed photo, concatenated, with the entry that owns each one."""

    def __init__(self, entries: list[dict[str, str]], points: np.ndarray, descriptors: np.ndarray,
                 owner: np.ndarray, cfg: ImageSearchConfig, backend_id: str = "") -> None:
        self.entries = entries  # {title, snippet, image}
        self.points = points
        self.descriptors = descriptors
        self.owner = owner
        self.cfg = cfg
        self.backend_id = backend_id or f"orb:{len(entries)}"

    @classmethod
    def build(cls, items: Iterable[tuple[np.ndarray, str, str, str]], cfg: ImageSearchConfig | None = None,
              backend_id: str = "") -> ImageIndex:
        """Index ``(rgb image, title, snippet, image name)`` items."""
        cfg = cfg or ImageSearchConfig()
        entries, pts, descs, owner = [], [], [], []
        for arr, title, snippet, name in items:
            p, d = _features(arr, cfg)
            owner.append(np.full(len(d), len(entries), np.int32))
            entries.append({"title": title, "snippet": snippet, "image": name})
            pts.append(p)
            descs.append(d)
        if not entries:
            raise DataError("image index: nothing to index")
        return cls(entries, np.concatenate(pts), np.concatenate(descs), np.concatenate(owner), cfg, backend_id)

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        meta = {"entries": self.entries, "backend_id": self.backend_id}
        np.savez(buf, points=self.points, descriptors=self.descriptors, owner=self.owner,
                 meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
        atomic_write(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path, cfg: ImageSearchConfig) -> ImageIndex:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            return cls(meta["entries"], z["points"], z["descriptors"], z["owner"], cfg, meta["backend_id"])

    def search(self, image: np.ndarray, top_k: int = 5) -> list[ImageHit]:
        """Best-first hits, one per title (numbered variants of one name count once)."""
        import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

        cfg = self.cfg
        pts, desc = _features(image, cfg)
        if len(desc) < 2:
            return []
        matcher = cv2.BFMatcher(cv2.NORM_HAMMING)  # one per call: OpenCV matchers are not thread-safe
        votes: dict[int, list[tuple[int, int]]] = {}
        for pair in matcher.knnMatch(desc, self.descriptors, k=2):
            if len(pair) == 2 and pair[0].distance < cfg.ratio * pair[1].distance:
                m = pair[0]
                votes.setdefault(int(self.owner[m.trainIdx]), []).append((m.queryIdx, m.trainIdx))
        ranked = sorted(votes.items(), key=lambda kv: -len(kv[1]))[:cfg.verify]
        scored: list[tuple[int, int]] = []
        for entry, matches in ranked:
            if len(matches) < 3:
                continue
            src = pts[[q for q, _ in matches]]
            dst = self.points[[t for _, t in matches]]
            # similarity transform (rotation, uniform scale, shift): what crop + resize do to a photo
            _, inliers = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=8.0)
            n = int(inliers.sum()) if inliers is not None else 0
            if n >= cfg.min_inliers:
                scored.append((n, entry))
        scored.sort(key=lambda t: (-t[0], t[1]))
        hits: list[ImageHit] = []
        seen: set[str] = set()
        for n, entry in scored:
            e = self.entries[entry]
            if e["title"].casefold() in seen:
                continue
            seen.add(e["title"].casefold())
            hits.append(ImageHit(e["title"], e["snippet"], float(n), e["image"]))
            if len(hits) == top_k:
                break
        return hits


def _features(arr: np.ndarray, cfg: ImageSearchConfig) -> tuple[np.ndarray, np.ndarray]:
    import cv2  # noqa: PLC0415 (d) osvl.tools.client imports without cv2 (a test checks)

    gray = cv2.cvtColor(arr, cv2.COLOR_RGB2GRAY) if arr.ndim == 3 else arr
    h, w = gray.shape
    long = max(h, w)
    if long > cfg.max_side:
        s = cfg.max_side / long
        gray = cv2.resize(gray, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_AREA)
    elif long < cfg.min_side:
        s = cfg.min_side / long
        gray = cv2.resize(gray, (max(1, round(w * s)), max(1, round(h * s))), interpolation=cv2.INTER_CUBIC)
    orb = cv2.ORB_create(nfeatures=cfg.features, fastThreshold=10)
    kps, desc = orb.detectAndCompute(gray, None)
    pts = np.array([k.pt for k in kps], np.float32).reshape(-1, 2)
    if desc is None:
        return pts[:0], np.zeros((0, 32), np.uint8)
    return pts, desc


def build_image_index(kg_dir: str | Path | None = None, cfg: ImageSearchConfig | None = None,
                      cache: bool = True) -> ImageIndex:
    """Index every anchor photo of a KG folder; cached under ``store_root()`` by content hash."""
    cfg = cfg or ImageSearchConfig()
    root = Path(kg_dir or cfg.kg_dir or SAMPLE_DIR)
    ent_path, anc_path = root / "entities.parquet", root / "anchors.parquet"
    for p in (ent_path, anc_path):
        if not p.is_file():
            raise DataError(f"image index: {p} does not exist (build the KG first)")
    digest = file_digest([ent_path, anc_path], json.dumps({**dataclasses.asdict(cfg), "v": INDEX_VERSION},
                                                          sort_keys=True))
    path = store_root() / "image_index" / f"{digest}.npz"
    if cache and path.is_file():
        return ImageIndex.load(path, cfg)
    ents = pq.read_table(ent_path, columns=["id", "title", "description", "text"]).to_pylist()
    by_id = {e["id"]: e for e in ents}
    anchors = pq.read_table(anc_path, columns=["entity_id", "image", "caption"]).to_pylist()

    def items() -> Iterable[tuple[np.ndarray, str, str, str]]:
        for a in anchors:
            e = by_id.get(a["entity_id"])
            if e is None:
                raise DataError(f"anchor {a['image']} names unknown entity {a['entity_id']}")
            with Image.open(root / "images" / a["image"]) as im:
                arr = np.asarray(im.convert("RGB"))
            yield arr, e["title"], page_snippet(e, a["caption"]), a["image"]

    index = ImageIndex.build(items(), cfg, backend_id=f"orb:{digest}")
    if cache:
        index.save(path)
    return index


def page_snippet(entity: dict[str, Any], caption: str = "", chars: int = 600) -> str:
    """What a reverse image search shows under a match: the page's description, then its opening text
    (the caption when the page has neither). Stored long; ``format_hits`` cuts it to ``snippet_chars``."""
    desc = (entity.get("description") or "").strip()
    text = " ".join((entity.get("text") or "").split())
    out = f"{desc}. {text}" if desc and text else (desc or text or caption)
    return out[:chars]


def format_hits(hits: list[ImageHit], image: str, snippet_chars: int) -> str:
    if not hits:
        return f"Reverse image search found no match for {image} in the image index."
    lines = [f"Reverse image search for {image} found {len(hits)} matching "
             f"entit{'y' if len(hits) == 1 else 'ies'}:"]
    for i, h in enumerate(hits, 1):
        snip = h.snippet if len(h.snippet) <= snippet_chars else h.snippet[:snippet_chars].rstrip() + " …"
        lines.append(f"{i}. {h.title}" + (f" — {snip}" if snip else "") + f" (match score {h.score:g})")
    return "\n".join(lines)


def image_search(ctx: ToolContext, image: Any = None, top_k: Any = 5) -> ToolResult:
    arr = ctx.image(image)
    k = number({"top_k": top_k}, "top_k", lo=1, hi=20, integer=True)
    backend = option_backend(ctx, "image_search")
    hits = backend.search(arr, k)
    snippet_chars = getattr(getattr(backend, "cfg", None), "snippet_chars", ImageSearchConfig.snippet_chars)
    return ToolResult("ok", format_hits(hits, image, snippet_chars),
                      data={"hits": [dataclasses.asdict(h) for h in hits]})


register(Tool(
    name="image_search",
    description="Reverse image search: find which known entity (landmark, artwork, animal, object) an image "
                "or a crop of it shows. Returns entity names with a short description.",
    parameters={
        "type": "object",
        "properties": {
            "image": IMAGE_ARG,
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5,
                      "description": "Number of entities to return."},
        },
        "required": ["image"],
    },
    fn=image_search,
    backend="orb-ransac",
    version="2",  # 2: page snippets
))
