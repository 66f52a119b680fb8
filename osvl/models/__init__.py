"""osvl.models: Hugging Face VLM checkpoints (Qwen3-VL, Qwen2.5-VL) and the tiny test model.

Import the submodules, not this package, for the heavy parts, so ``import osvl.models`` stays
free of torch and transformers:

* ``osvl.models.load``: ``load_model(path, dtype, device, attn_implementation)``,
  ``load_processor(path)`` (the full multimodal processor with the pinned, torchvision-free image
  processor and osvl's chat template), ``load_tokenizer(path)``; bad checkpoints raise
  ``ModelLoadError``.
* ``osvl.models.tiny``: ``tiny_checkpoint(kind)``, the cached tiny random-init checkpoint
  directory that tests and the demo use.
* ``osvl.models.pretrain``: the LM pretraining loop and corpus of ``jobs/pretrain_tiny.py`` (the tiny policy
  taught to copy before SFT).
* ``osvl.models.job``: that job's config and ``run``.
"""
