"""Build the committed embedded KG sample from the shared data: ``python -m osvl.kg.build_sample``.

What goes in: every Wikispeedia entity and link (trimmed text, infobox attributes,
categories), the Wikidata short descriptions and the ~8,000 summary-only entities linked
to the titles their extracts mention, MediaWiki-sample redirects as aliases where titles
overlap, and the anchor photos that ground an entity (downscaled to <= 512 px, JPEG),
with ATTRIBUTION.md listing source and licence per file. Prints one JSON line of counts
(also saved as ``build_report.json``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from PIL import Image

from osvl.config import input_path, opt, parse_args
from osvl.kg import anchors as anc
from osvl.kg import mediawiki, wikispeedia
from osvl.kg.grounding import Candidate, GroundingConfig, entity_text, ground, make_scorer
from osvl.kg.schema import SAMPLE_DIR, eligible_values, fold, write_kg

MAX_SIDE = 512


@dataclasses.dataclass
class BuildSampleConfig:
    data: str = opt("$OSVL_SHARED_DATA", "The shared data folder (read-only inputs; $OSVL_SHARED_DATA expanded).",
                    hashed=False)
    out: str = opt(str(SAMPLE_DIR), "Output KG folder (the committed sample by default).", hashed=False)
    text_chars: int = opt(1000, "Characters of article text kept per entity (keeps entities.parquet < 5 MB).")
    max_distractors: int = opt(20, "At most this many caption-named entities compete with the target.")
    grounding: GroundingConfig = opt(GroundingConfig, "Anchor grounding (scorer, thresholds).")


def _save_image(img, path: Path) -> None:
    im = Image.fromarray(img)
    im.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    im.save(path, "JPEG", quality=85, optimize=True)


def _image_name(src: anc.AnchorSource) -> str:
    stem = src.source.replace("skimage.data.", "skimage/").rsplit(".", 1)[0] if "/" in src.source else src.source
    return fold(stem.replace("/resource/", "/").replace("/", " ")).replace(" ", "_") + ".jpg"


def build(cfg: BuildSampleConfig) -> dict:
    t0 = time.time()
    data, out = input_path(cfg.data), Path(cfg.out)
    entities, links = wikispeedia.load(data / "wikispeedia", data / "wikidata" / "summaries_en.json", cfg.text_chars)
    by_id = {e["id"]: e for e in entities}
    by_title = {fold(e["title"]): e["id"] for e in entities}

    # MediaWiki redirects whose target is a KG title become aliases of it
    redirects = 0
    for page in mediawiki.iter_pages(data / "mediawiki" / "enwiki-pages-articles-sample.xml.bz2"):
        if page.ns == 0 and page.redirect and fold(page.redirect) in by_title:
            by_id[by_title[fold(page.redirect)]]["aliases"].append(page.title)
            redirects += 1

    def alias_index() -> dict[str, list[int]]:
        idx: dict[str, list[int]] = {}
        for e in entities:
            names = list(e["aliases"])
            if "(" in e["title"]:  # "Christ the Redeemer (statue)" is named without its disambiguator
                names.append(e["title"].split("(")[0])
            for a in names:
                if fold(a) and by_title.get(fold(a)) != e["id"] and e["id"] not in idx.get(fold(a), []):
                    idx.setdefault(fold(a), []).append(e["id"])
        return idx

    by_alias = alias_index()
    sources = anc.read_gcompris(data / "images" / "gcompris") + anc.skimage_sources()
    scorer = make_scorer(cfg.grounding)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for old in (out / "images").glob("*.jpg"):
        old.unlink()
    anchors, attribution, rejected, unmatched = [], [], [], []
    for src in sources:
        eid = next((i for n in [src.name, *src.extra_names] if (i := anc.match_entity(n, by_title, by_alias))
                    is not None), None)
        if eid is None and src.artist and fold(src.artist) in by_title:
            # a painting the KG lacks: it becomes an entity linked to its painter
            eid = len(by_id)
            artist_id = by_title[fold(src.artist)]
            row = {"id": eid, "title": src.name, "aliases": [], "description": f"Painting by {src.artist}",
                   "text": f"{src.name} is a {src.year} painting by {src.artist}.", "images": [],
                   "attributes": [{"key": "Artist", "value": src.artist, "source": src.caption},
                                  {"key": "Year", "value": src.year, "source": src.caption}],
                   "categories": ["subject.Art.Paintings"], "kind": "article", "origin": "manifest"}
            entities.append(row)
            by_id[eid] = row
            by_title[fold(src.name)] = eid
            links.append((eid, artist_id, "Artist"))
        if eid is None:
            unmatched.append(src.name)
            continue
        if not src.licence:  # never redistribute a file whose licence we cannot state
            rejected.append({"name": src.name, "entity": by_id[eid]["title"], "score": None, "reason": "no_licence"})
            continue
        target = by_id[eid]
        image = src.load(data / "images" / "gcompris")
        dis_ids = wikispeedia.mention_links(src.caption, by_title, eid, any_case=True)[: cfg.max_distractors]
        dis = [entity_text(by_id[i], cfg.grounding.max_text_chars) for i in dis_ids]
        g = ground(scorer, entity_text(target, cfg.grounding.max_text_chars), [Candidate(src.name, src.caption, image)],
                   [dis], cfg.grounding.margin, cfg.grounding.background)[0]
        if not g.accepted:
            rejected.append({"name": src.name, "entity": target["title"], "score": round(g.score, 3),
                             "reason": g.reason})
            continue
        name = _image_name(src)
        _save_image(image, out / "images" / name)
        target["images"].append(name)
        anchors.append({"entity_id": eid, "image": name, "caption": src.caption, "source": src.source,
                        "licence": src.licence, "score": g.score, "scorer": scorer.name})
        attribution.append(f"| `images/{name}` | {target['title']} | `{src.source}` | {src.licence or 'see source'} |")

    counts = write_kg(out, entities, links, anchors)
    _write_attribution(out, attribution)
    in_deg: dict[int, int] = {}
    for _, d, _ in {(s, d, "") for s, d, _ in links}:
        in_deg[d] = in_deg.get(d, 0) + 1
    degs = sorted(in_deg.values())
    ok = eligible_values((e["attributes"] for e in entities), len(entities))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    report = {
        **counts,
        "grounded_entities": len({a["entity_id"] for a in anchors}),
        "rejected_anchors": len(rejected),
        "unmatched_sources": len(unmatched),
        "redirect_aliases": redirects,
        "in_degree_p99": degs[int(0.99 * (len(degs) - 1))] if degs else 0,
        "eligible_values": len(ok),
        "size_mb": round(size / 2**20, 2),
        "seconds": round(time.time() - t0, 1),
        "rejected": rejected,
        "unmatched": unmatched,
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


def _write_attribution(out: Path, rows: list[str]) -> None:
    text = f"""# Attribution of the embedded KG sample

Built by `python -m osvl.kg.build_sample` from the shared data; redistributed under the
licences below. Text content is Wikipedia content (CC BY-SA 3.0/4.0 and GFDL).

| file | source | licence |
|---|---|---|
| `entities.parquet`, `links.parquet` | Wikispeedia (Wikipedia for Schools 2007): West & Leskovec, \
*Human Wayfinding in Information Networks*, WWW 2012; West, Pineau & Precup, *Wikispeedia*, IJCAI 2009 \
| CC BY-SA / GFDL |
| `entities.parquet` (descriptions, summary-only entities) | Wikipedia lead extracts and Wikidata short \
descriptions | CC BY-SA 4.0 (extracts), CC0 (Wikidata) |
| `entities.parquet` (aliases) | English Wikipedia `pages-articles` export, redirects | CC BY-SA / GFDL |
| `anchors.parquet` | captions from the GCompris manifests and scikit-image docs | as per image below |

## Images (downscaled to at most {MAX_SIDE} px)

GCompris images come from the GCompris educational suite (KDE); each line gives the per-file
licence, copyright and Wikimedia Commons source from the README next to the original file.
scikit-image photos are from `skimage.data`, licences as stated in scikit-image's data README.

| file | entity | original | licence; copyright; source |
|---|---|---|---|
""" + "\n".join(rows) + "\n"
    (out / "ATTRIBUTION.md").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(BuildSampleConfig, "build_sample", sys.argv[1:] if argv is None else argv, default_profile="")
    report = build(cfg)
    print(json.dumps({k: v for k, v in report.items() if k not in ("rejected", "unmatched")}))


if __name__ == "__main__":
    main()
