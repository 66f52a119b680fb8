"""The shared training kit: DeepSpeed engines and checkpoints, batching, device placement, the GPU rehearsal
(SFT in ``osvl.sft`` and the GRPO learner in ``osvl.rl`` both build on it)."""
