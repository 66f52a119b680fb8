"""Anchor grounding: the MiniLM caption scorer on real captions, and the CLIP code path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from osvl.errors import ConfigError, ModelLoadError
from osvl.kg import wikispeedia
from osvl.kg.grounding import (
    Candidate,
    ClipScorer,
    GroundingConfig,
    MiniLMScorer,
    entity_text,
    ground,
    make_scorer,
)
from osvl.kg.schema import load_kg


@pytest.fixture(scope="module")
def kg():
    return load_kg()


@pytest.fixture(scope="module")
def minilm():
    return MiniLMScorer(GroundingConfig().minilm_threshold)


def _ground(kg, scorer, title: str, cand: Candidate):
    """Ground one candidate against the KG entity ``title`` exactly as the sample build does."""
    cfg = GroundingConfig()
    eid = kg.find(title)[0]
    named = wikispeedia.mention_links(cand.caption, kg.by_title, eid, any_case=True)
    dis = [entity_text(kg.entities[i]) for i in named]
    return ground(scorer, entity_text(kg.entities[eid]), [cand], [dis[:20]], cfg.margin, cfg.background)[0]


@pytest.mark.slow  # loads a transformer model (~10 s on 2 busy cores)
def test_world_music_photos_do_not_ground_their_region(shared_data: Path, kg, minilm) -> None:
    items = json.loads((shared_data / "images" / "gcompris" / "manifest.json").read_text())
    music = [x for x in items if x["collection"] == "explore_world_music" and kg.find(x["name"])]
    assert len(music) >= 5  # Australia, Africa, Japan, Italy, Mexico, Middle East are KG titles
    for x in music:
        g = _ground(kg, minilm, x["name"], Candidate(x["name"], x["caption"]))
        assert not g.accepted, (x["name"], g.score, g.reason)
    # the same scorer grounds the monument and animal photos of the same manifest
    for name in ("Eiffel Tower", "Koala", "Colosseum", "Giraffe"):
        x = next(x for x in items if x["name"] == name)
        g = _ground(kg, minilm, name, Candidate(name, x["caption"]))
        assert g.accepted and g.score >= minilm.threshold, (name, g.score, g.reason)


@pytest.mark.slow  # loads a transformer model (~10 s on 2 busy cores)
def test_sudoku_does_not_ground_the_eiffel_tower(shared_data: Path, kg, minilm) -> None:
    from PIL import Image

    img = np.asarray(Image.open(shared_data / "images" / "opencv" / "sudoku.png").convert("RGB"))
    sudoku = Candidate("sudoku.png", "A sudoku puzzle printed in a newspaper, photographed at an angle", img)
    g = _ground(kg, minilm, "Eiffel Tower", sudoku)
    assert not g.accepted and g.reason == "below_threshold" and g.score < 0.2


@pytest.mark.slow  # loads a transformer model (~10 s on 2 busy cores)
def test_ground_ranks_and_counts_rejections(kg, minilm) -> None:
    target = entity_text(kg.entities[kg.find("Eiffel Tower")[0]])
    cands = [
        Candidate("a", "A sudoku puzzle printed in a newspaper"),
        Candidate("b", "The Eiffel Tower, the wrought-iron lattice tower on the Champ de Mars in Paris"),
        Candidate("c", "The Eiffel Tower seen from the river Seine at night"),
    ]
    out = ground(minilm, target, cands, margin=0.15, background=GroundingConfig().background)
    assert [g.candidate.name for g in out][-1] == "a" and not out[-1].accepted
    assert [g.accepted for g in out] == [True, True, False] and out[0].score >= out[1].score
    assert sum(not g.accepted for g in out) == 1
    with pytest.raises(ConfigError):
        ground(minilm, target, cands, distractors=[[]])


def test_sample_anchor_scores_are_recorded(kg) -> None:
    thr = GroundingConfig().minilm_threshold
    scores = [a["score"] for rows in kg.anchors.values() for a in rows]
    assert len(scores) >= 30 and min(scores) >= thr
    assert {a["scorer"] for rows in kg.anchors.values() for a in rows} == {"minilm"}
    report = json.loads((kg.root / "build_report.json").read_text())
    assert report["rejected_anchors"] >= 6  # the world-music photos at least


def _tiny_clip(path: Path) -> None:
    """A random-init CLIP with a 6-token vocabulary: proves the code path, not the accuracy."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "a</w>": 2, "photo</w>": 3, "of</w>": 4, "tower</w>": 5}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                            crop_size={"height": 32, "width": 32}), tokenizer=tok)
    cfg = CLIPConfig(
        text_config={"vocab_size": 6, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 32, "bos_token_id": 0,
                     "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 1, "num_attention_heads": 2},
        projection_dim=16,
    )
    CLIPModel(cfg).save_pretrained(str(path))
    proc.save_pretrained(str(path))


@pytest.mark.slow  # loads a transformer model (~10 s on 2 busy cores)
def test_clip_scorer_code_path(tmp_path: Path) -> None:
    _tiny_clip(tmp_path)
    cfg = GroundingConfig(clip_path=str(tmp_path))
    scorer = make_scorer(cfg)
    assert isinstance(scorer, ClipScorer) and scorer.threshold == 0.28
    rng = np.random.default_rng(0)
    cands = [Candidate(f"c{i}", "", rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for i in range(2)]
    sims = scorer.score(cands, ["a photo of a tower", "a photo"])
    assert sims.shape == (2, 2) and np.all(np.abs(sims) <= 1.0 + 1e-5)
    assert not np.allclose(sims[0], sims[1])  # different images, different scores
    out = ground(scorer, "a photo of a tower", cands, margin=0.0)
    assert len(out) == 2 and all(g.reason in ("ok", "below_threshold") for g in out)
    with pytest.raises(ConfigError):
        scorer.score([Candidate("no image", "caption only")], ["a tower"])


def test_scorer_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="clip_path"):
        make_scorer(GroundingConfig(scorer="clip"))
    with pytest.raises(ModelLoadError):
        ClipScorer(tmp_path / "missing")
