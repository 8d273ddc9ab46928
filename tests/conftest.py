"""Test-session settings: tiny models run fastest on one CPU thread (less thread overhead than
work), and tests must never reach a model hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch
except ImportError:  # memgym-only environments
    torch = None

if torch is not None:
    torch.set_num_threads(1)
