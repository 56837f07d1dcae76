"""The vLLM test tier: vLLM 0.33.0's real Scheduler and connector lifecycle, on CPU.

Runs under `.venv-vllm` (`make vllm-tier`), never under the main environment. No hub, no
weights: a model directory holding only a tiny Llama `config.json` is enough for
`ModelConfig(skip_tokenizer_init=True)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM picks its platform at import time.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from kvhandoff.integrations.vllm.bench import TINY_LLAMA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A config-only model directory, made at test time (nothing committed, nothing fetched)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    yield path
