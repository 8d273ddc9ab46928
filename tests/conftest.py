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


if torch is not None:
    import pytest

    @pytest.fixture(scope="session")
    def cache(tmp_path_factory):
        """One model cache per test session: each preset is built once."""
        return tmp_path_factory.getbasetemp() / "memopd-cache"

    @pytest.fixture(scope="session")
    def tiny(cache):
        """The ``tiny`` preset (model, tokenizer) from the session cache."""
        from agents import models

        return models.load("tiny", cache_dir=cache)
