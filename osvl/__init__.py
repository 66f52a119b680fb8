"""osvl: Ray-native training of multimodal deep-search agents (the OpenSearch-VL recipe).

Importing ``osvl`` is cheap on purpose: it starts no Ray, downloads nothing and
imports none of ray, torch, transformers or deepspeed (a test checks it). The
heavy libraries are imported by the submodules that need them.
"""

__version__ = "0.1.0"
