"""`--input FILE`: run the model on the user's own tokens instead of random ids.

* `.json`: a list of equal-length token-id lists (batch × seq), used as is for every batch.
* `.txt`: text, tokenized with the model's own tokenizer — only for Hugging Face targets
  whose folder holds one (loaded with `local_files_only=True`, never downloaded, never
  its own code). The token
  stream is cut into `--batch` rows of `--seq-len` tokens (default 64, capped by the model's
  maximum positions); a text shorter than that gives one shorter row.

Real text matters for the statistics that random ids hide (outlier channels and massive
activations appear on frequent tokens), which is why this exists at all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from actscan.errors import BadInputError
from actscan.files import INPUT_CAP, read_text_bounded, regular_file
from actscan.measure.inputs import Batch, InputSource, file_tokens
from actscan.targets.hf_env import load_tokenizer
from actscan.targets.resolved import Resolved, TargetOptions

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)
DEFAULT_SEQ = 64
DEFAULT_BATCH = 4


def load_input_file(
    path: Path, resolved: Resolved, opts: TargetOptions | None = None
) -> InputSource:
    """An input source for `resolved.model` from a .json token file or a .txt text file."""
    opts = opts or TargetOptions()
    path = Path(path)
    regular_file(path, label=f"--input {path}")  # a FIFO or a device is never opened
    suffix = path.suffix.lower()
    info = resolved.info
    if suffix == ".json":
        ids = file_tokens(path, info.vocab_size)
    elif suffix == ".txt":
        ids = _tokenize_text(path, resolved, opts)
    else:
        raise BadInputError(
            f"--input {path}: unsupported type '{path.suffix or path.name}' "
            "(.json list of token-id lists, or .txt text for a model with a tokenizer)"
        )
    max_pos = info.arch.get("max_positions")
    if isinstance(max_pos, int) and ids.shape[1] > max_pos:
        raise BadInputError(
            f"--input {path}: sequences of {ids.shape[1]} tokens are longer than the model's "
            f"{max_pos} positions"
        )
    batch = _wrap(ids, resolved)
    return lambda _i: batch


def _wrap(ids: torch.Tensor, resolved: Resolved) -> Batch:
    """Positional ids for the built-in and custom models; keywords for transformers models."""

    info = resolved.info
    if info.family in ("actscan-gpt", "custom"):
        return Batch(args=(ids,))
    kwargs: dict[str, Any] = {"input_ids": ids}
    if info.task == "encoder":
        kwargs["attention_mask"] = torch.ones_like(ids)
    return Batch(kwargs=kwargs)


def tokenizer_folder(resolved: Resolved) -> Path | None:
    """The folder a Hugging Face target came from, if it holds tokenizer files."""
    candidates: list[Path] = []
    for key in ("tokenizer_dir", "folder"):
        value = resolved.extra.get(key)
        if value:
            candidates.append(Path(value))
    source = Path(resolved.info.source)
    if source.is_dir():
        candidates.append(source)
    elif source.suffix.lower() in (".safetensors", ".json") and resolved.info.family not in (
        "actscan-gpt",
        "custom",
    ):
        candidates.append(source.parent)
    for folder in candidates:
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    return None


def token_decoder(path: Path, resolved: Resolved) -> Callable[[int], str] | None:
    """id -> text with the model's own tokenizer, for `--input` text files (the per-token
    view names the token); None for token-id files or when no tokenizer loads."""
    if Path(path).suffix.lower() != ".txt":
        return None
    folder = tokenizer_folder(resolved)
    if folder is None:
        return None
    try:
        tok = load_tokenizer(folder)
    except Exception:  # the text was tokenized already: ids without text are still right
        return None
    return lambda i: str(tok.decode([i]))


def _tokenize_text(path: Path, resolved: Resolved, opts: TargetOptions) -> torch.Tensor:

    folder = tokenizer_folder(resolved)
    if folder is None:
        raise BadInputError(
            f"--input {path}: text needs the model's tokenizer, and {resolved.info.source} "
            "has none; give token ids as a .json list of lists instead"
        )
    text = read_text_bounded(path, cap=INPUT_CAP, label=f"--input {path}", what="--input file")
    if not text.strip():
        raise BadInputError(f"--input {path}: the file is empty")
    try:
        tok = load_tokenizer(folder)
        ids: list[int] = list(tok(text, verbose=False)["input_ids"])
    except BadInputError as err:
        raise BadInputError(f"--input {path}: {err}") from None
    except Exception as err:
        first = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise BadInputError(f"--input {path}: the tokenizer in {folder} failed: {first}") from None
    if not ids:
        raise BadInputError(f"--input {path}: the tokenizer produced no tokens")
    vocab = resolved.info.vocab_size
    if vocab is not None and max(ids) >= vocab:
        raise BadInputError(
            f"--input {path}: the tokenizer gives id {max(ids)}, outside the model's "
            f"vocabulary of {vocab}"
        )
    max_pos = resolved.info.arch.get("max_positions")
    seq = opts.seq_len or DEFAULT_SEQ
    if isinstance(max_pos, int):
        seq = min(seq, max_pos)
    seq = min(seq, len(ids))
    rows = max(1, min(opts.batch or DEFAULT_BATCH, len(ids) // seq))
    return torch.tensor(ids[: rows * seq], dtype=torch.long).view(rows, seq)
