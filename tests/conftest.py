"""Fixtures and hooks: offline Hugging Face, one intra-op thread, the golden-file fixture
and the check runner a test plants. Shared builders live in helpers.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from helpers import UPDATE_ENV, UPDATE_FLAG, check_golden

# Tiny models are dominated by threading overhead on a shared 2-core machine.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        UPDATE_FLAG,
        action="store_true",
        help=f"rewrite tests/golden/* from the current output (or {UPDATE_ENV}=1); "
        "review the diff before committing",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """`golden(name, text)`: assert `text` equals tests/golden/NAME (see check_golden)."""
    update = bool(request.config.getoption(UPDATE_FLAG)) or os.environ.get(UPDATE_ENV) == "1"
    return lambda name, text: check_golden(name, text, update=update)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test on one intra-op thread (tiny models only spin with more), restored after
    tests that change it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
