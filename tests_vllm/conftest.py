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

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A config-only model directory, made at test time (nothing committed, nothing fetched)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    yield path
