"""How actscan talks to transformers: offline always, and without its config advice.

Shared by the Hugging Face resolver (hf.py), the per-layer config lists (hf_layers.py) and
the sharded build; a module of its own so those need not import each other for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["offline", "quiet"]


def offline() -> None:
    """Never touch the network, whatever the user's environment says."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers logs config advice (token ids, is_decoder) that is noise here."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
