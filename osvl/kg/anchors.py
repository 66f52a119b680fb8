"""Anchor-image candidates: named photos from manifests and packages, matched to KG entities.

Sources: the two gcompris manifests (``manifest.json`` with name/caption/image, and
``categorization/manifest.json`` with a name derived from the file name), and a few named
photos inside scikit-image. Each becomes an ``AnchorSource`` with its caption and per-file
licence (parsed from the Debian-copyright-style README next to the files). Matching a name
to an entity goes through ``match_entity``: exact title, then aliases (redirects, names in
the lead, manifest names), then title without its "(disambiguator)", then a unique title
prefix ("Burj" -> "Burj Khalifa"). A match is only a *candidate*: whether the photo shows
the entity is decided by ``osvl.kg.grounding``.

Artworks in the ``details`` collection come as "Artist, Title - year"; the title names the
painting, not the artist, so they are returned with ``artist``/``year`` set and the
builder adds the painting as its own entity when the KG lacks it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import skimage.data
from PIL import Image

from osvl.errors import DataError
from osvl.kg.schema import fold

SKIMAGE_PHOTOS = {
    # skimage.data name -> (entity name, caption, licence as stated in scikit-image's data README)
    "astronaut": ("Astronaut", "An astronaut in a spacesuit: NASA astronaut Eileen Collins, Space Shuttle pilot "
                  "and commander", "Public domain (NASA)"),
    "rocket": ("Rocket", "A SpaceX Falcon 9 rocket lifting off from its launch pad in a cloud of exhaust",
               "Public domain (SpaceX)"),
    "coffee": ("Coffee", "A cup of coffee with milk foam on a saucer", "CC0 (Rachel Michetti)"),
    "chelsea": ("Cat", "A cat: Chelsea, a tabby domestic cat", "CC0 (Stefan van der Walt)"),
    "moon": ("Moon", "Surface of the Moon with its craters, in grey", "Public domain"),
    "coins": ("Coin", "Ancient Greek coins, metal money from Pompeii", "Public domain (Brooklyn Museum)"),
}


@dataclass
class AnchorSource:
    name: str  # the name to match against the KG
    caption: str
    source: str  # relative path under the images folder, or "skimage.data.<name>"
    licence: str
    collection: str
    artist: str = ""
    year: str = ""
    extra_names: list[str] = field(default_factory=list)

    def load(self, images_root: Path | None) -> np.ndarray:
        """The photo as a uint8 RGB array."""
        if self.source.startswith("skimage.data."):
            img = getattr(skimage.data, self.source.rsplit(".", 1)[1])()
        else:
            with Image.open(Path(images_root) / self.source) as im:
                img = np.asarray(im.convert("RGB"))
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        return np.ascontiguousarray(img[..., :3]).astype(np.uint8)


def read_licences(root: Path) -> dict[str, str]:
    """Relative image path -> "licence; copyright; source" from every README under ``root``."""
    out: dict[str, str] = {}
    for readme in root.rglob("README"):
        base = readme.parent.relative_to(root)
        for block in re.split(r"\n\s*\n", readme.read_text(encoding="utf-8", errors="replace")):
            fields: dict[str, str] = {}
            files: list[str] = []
            in_files = False
            for line in block.splitlines():
                m = re.match(r"^(\w+):\s*(.*)$", line)
                if m and m.group(1) in ("Copyright", "License", "Source", "Comment", "Files"):
                    in_files = m.group(1) == "Files"
                    if in_files and m.group(2):
                        files.append(m.group(2).strip())
                    elif not in_files:
                        fields[m.group(1)] = (fields.get(m.group(1), "") + " " + m.group(2)).strip()
                elif (in_files and line.strip()) or re.match(r"^\S+\.(webp|png|jpe?g|svg|ogg)$", line.strip()):
                    files.append(line.strip())  # some blocks list their files without a "Files:" header
            text = "; ".join(f"{k}: {fields[k]}" for k in ("License", "Copyright", "Source", "Comment") if k in fields)
            for f in files:
                out[str(base / f)] = text
    return out


def _licence_for(licences: dict[str, str], path: str) -> str:
    # READMEs list files relative to their folder; the manifest path may sit deeper or shallower
    if path in licences:
        return licences[path]
    hits = [v for k, v in licences.items() if path.endswith(k) or k.endswith(path)]
    if hits:
        return hits[0]
    stem = Path(path).name
    hits = [v for k, v in licences.items() if Path(k).name == stem and Path(path).parent.name in k]
    return hits[0] if hits else ""


def read_gcompris(root: str | Path) -> list[AnchorSource]:
    """Both gcompris manifests as anchor sources (captioned; licence per file)."""
    root = Path(root)
    if not (root / "manifest.json").is_file():
        raise DataError(f"{root} has no manifest.json")
    licences = read_licences(root)
    out: list[AnchorSource] = []
    for item in json.loads((root / "manifest.json").read_text(encoding="utf-8")):
        name, caption = item["name"], item.get("caption") or ""
        artist = year = ""
        m = re.match(r"^(Vincent van Gogh),\s*(.+?)\s*-?\s*(\d{4})(?:-\d+)?$", name)
        if m:  # "Artist, Title - year": the photo shows the painting, not the painter
            artist, name, year = m.group(1), m.group(2).strip(" -"), m.group(3)
            caption = caption or f"{name}, a painting by {artist} ({year})"
        out.append(AnchorSource(name, caption or name, item["image"], _licence_for(licences, item["image"]),
                                item.get("collection", ""), artist, year,
                                extra_names=[p.strip() for p in re.split(r",| in | at | seen from ", name)[:1]]))
    cat_root = root / "categorization"
    for item in json.loads((cat_root / "manifest.json").read_text(encoding="utf-8")):
        name = item.get("name") or item.get("name_from_filename") or Path(item["image"]).stem
        name = re.sub(r"\d+$", "", name).strip()
        if not name:
            continue
        coll = item.get("collection", "")
        # the folder says what kind of thing it is, but naming "renewable energy" in a dam's caption
        # would make that entity a distractor; only monuments get their kind said
        caption = f"A photo of {name}, a famous monument." if coll == "monuments" else f"A photo of a {name.lower()}."
        out.append(AnchorSource(name, caption, item["image"],
                                _licence_for(licences, item["image"]), f"categorization/{coll}"))
    return out


def skimage_sources() -> list[AnchorSource]:
    return [
        AnchorSource(ent, cap, f"skimage.data.{n}", lic, "skimage") for n, (ent, cap, lic) in SKIMAGE_PHOTOS.items()
    ]


def match_entity(name: str, by_title: dict[str, int], by_alias: dict[str, list[int]]) -> int | None:
    """Entity id that ``name`` names, or None. Ambiguous aliases match nothing."""
    variants = [name, re.sub(r"^the\s+", "", name, flags=re.I)]
    for v in variants:
        k = fold(v)
        if k in by_title:
            return by_title[k]
        ids = by_alias.get(k, [])
        if len(ids) == 1:
            return ids[0]
    k = fold(variants[-1])
    prefixed = [i for t, i in by_title.items() if t.startswith(k + " ") and len(t.split()) <= len(k.split()) + 2]
    return prefixed[0] if len(k) >= 4 and len(prefixed) == 1 else None
