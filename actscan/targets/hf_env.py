"""How actscan talks to transformers: offline always, never a model folder's own code,
never a question on stdin, and without its config advice.

Shared by the Hugging Face resolver (hf.py), the per-layer config lists (hf_layers.py),
the `--input` tokenizer (inputs_file.py) and the sharded build; a module of its own so
those need not import each other for it.

Custom code: a folder's `auto_map` (config.json, tokenizer_config.json, ...) names Python
files of its own. transformers runs them when `trust_remote_code` is true and, when it is
left unset, asks "Do you wish to run the custom code? [y/N]" on stdin, where a piped `y`
is enough. So every loader is called with `trust_remote_code=False`, and `no_prompt()`
gives transformers an empty stdin besides, so nothing it could ask can be answered.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from actscan.errors import BadInputError
from actscan.files import INPUT_CAP, mib, regular_file

__all__ = ["NO_REMOTE_CODE", "load_tokenizer", "no_prompt", "offline", "quiet"]

# Keywords of every transformers loader actscan calls (from_pretrained, from_config).
NO_REMOTE_CODE: dict[str, Any] = {"trust_remote_code": False}


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


@contextlib.contextmanager
def no_prompt() -> Iterator[None]:
    """stdin is empty while transformers loads: a question it asks reads end of file (an
    error, not consent), whatever the user typed or piped."""
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer in `folder`: local files only, transformers' own classes only (an
    `auto_map` tokenizer gets transformers' class for its files, or fails)."""
    offline()
    from transformers import AutoTokenizer

    _guard_folder(folder)
    try:
        with no_prompt():
            return AutoTokenizer.from_pretrained(
                str(folder), local_files_only=True, **NO_REMOTE_CODE
            )
    except ValueError as err:  # transformers' refusal of custom code it was not allowed
        if "trust_remote_code" not in str(err):
            raise
        raise BadInputError(
            f"the tokenizer in {folder} is custom code (auto_map) with no transformers class "
            "for its files, and actscan never runs a folder's code"
        ) from None


# The tokenizer files transformers may open by name (vocabularies, merges, templates).
_TEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def _guard_folder(folder: Path) -> None:
    """transformers opens tokenizer files by names actscan does not choose, so every
    entry of the folder is checked first, unopened (actscan/files.py): nothing but
    regular files and folders, and no text file past INPUT_CAP."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:  # no folder to read: transformers says what is missing
        return
    for entry in entries:
        if entry.is_dir():
            continue
        st = regular_file(entry, label=f"tokenizer file {entry}")
        if entry.suffix.lower() in _TEXT_SUFFIXES and st.st_size > INPUT_CAP:
            raise BadInputError(
                f"tokenizer file {entry}: {st.st_size} bytes is more than the "
                f"{mib(INPUT_CAP)} actscan lets a tokenizer read"
            )
