"""Shared fixtures: a CLI runner, tiny Hugging Face model folders saved with save_pretrained."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import hf_tiny` as well as `from tests.hf_tiny import ...`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
# each pytest-xdist worker gets its share of the cores (two workers with two threads each fight over two cores)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture
def cli():
    """Invoke the normconv CLI in-process: cli(args...) -> (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from normconv.cli import app

    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return invoke


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """name -> folder of a tiny HF model written with save_pretrained (safetensors + config.json)."""
    from hf_tiny import TINY

    root = tmp_path_factory.mktemp("hf")
    folders = {}
    for name in ("bert", "gpt2", "llama", "t5"):
        model, _ = TINY[name]()
        model.save_pretrained(root / name)
        folders[name] = root / name
    return folders
