"""Inputs and losses for one measured pass.

An input source is a function batch_index -> (args, kwargs) for `model(*args, **kwargs)`.
Random token ids are seeded per batch so both sides of a comparison see the same data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actscan.errors import BadInputError, UsageError
from actscan.files import INPUT_CAP, loads_json, read_bounded
from actscan.measure.recorder import first_tensor


@dataclass(frozen=True)
class Batch:
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def token_ids(self) -> torch.Tensor | None:
        ids = self.kwargs.get("input_ids")
        if ids is None and self.args and isinstance(self.args[0], torch.Tensor):
            ids = self.args[0]
        return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None

    def to(self, device: torch.device) -> Batch:
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return Batch(
            tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}
        )


InputSource = Callable[[int], Batch]


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def token_source(
    vocab_size: int,
    batch: int,
    seq_len: int,
    seed: int,
    *,
    mask: bool = False,
    as_kwargs: bool = False,
) -> InputSource:
    """Random ids (B, T); with `mask` an all-ones attention_mask is passed too (encoders)."""

    def source(i: int) -> Batch:
        ids = random_tokens(vocab_size, batch, seq_len, seed, i)
        if mask or as_kwargs:
            kw: dict[str, Any] = {"input_ids": ids}
            if mask:
                kw["attention_mask"] = torch.ones_like(ids)
            return Batch(kwargs=kw)
        return Batch(args=(ids,))

    return source


def tensor_source(shape: Sequence[int], seed: int) -> InputSource:
    """Standard-normal float input of `shape` (for `module:callable` models)."""

    def source(i: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        return Batch(args=(torch.randn(*shape, generator=gen),))

    return source


def user_source(inputs: Any) -> InputSource:
    """The Python API's `inputs`: a tensor, a tuple of args, a dict of kwargs, a list of
    those (one per batch, cycled) or a callable batch_index -> any of them."""

    def wrap(obj: Any) -> Batch:
        if isinstance(obj, Batch):
            return obj
        if isinstance(obj, dict):
            return Batch(kwargs=dict(obj))
        if isinstance(obj, tuple):
            return Batch(args=obj)
        return Batch(args=(obj,))

    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        return lambda i: wrap(inputs(i))
    if isinstance(inputs, list):
        if not inputs:
            raise UsageError("inputs is an empty list")
        return lambda i: wrap(inputs[i % len(inputs)])
    return lambda i: wrap(inputs)


def file_tokens(path: Path, vocab_size: int | None) -> torch.Tensor:
    """`--input FILE.json`: a list of equal-length token-id lists (batch × seq), read
    bounded (a regular file under INPUT_CAP, actscan/files.py); every id is checked in
    Python before a tensor is made, so an id past int64 is a refusal, not an overflow."""
    label = f"--input {path}"
    data = loads_json(read_bounded(path, cap=INPUT_CAP, label=label, what="--input file"), label)
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(r, list) and r and all(type(t) is int for t in r) for r in data)
    ):
        raise BadInputError(f"{label}: expected a non-empty list of non-empty lists of ints")
    if len({len(r) for r in data}) != 1:
        raise BadInputError(f"{label}: token-id lists must all have the same length")
    top = vocab_size if vocab_size is not None else 2**63
    bad = next((t for r in data for t in r if not 0 <= t < top), None)
    if bad is not None:
        shown = str(bad) if len(str(bad)) <= 24 else f"{str(bad)[:20]}… ({len(str(bad))} digits)"
        raise BadInputError(f"{label}: token id {shown} is outside [0, {vocab_size or top})")
    return torch.tensor(data, dtype=torch.long)


# -- losses -----------------------------------------------------------------------------


def _logits(output: Any) -> torch.Tensor | None:
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    return first_tensor(output)


def next_token_loss(output: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = _logits(output)
    if logits is None or logits.dim() != 3:
        raise UsageError("next-token loss needs logits of shape (batch, seq, vocab)")
    if logits.shape[1] > ids.shape[1]:
        # positions the model prepends to the text (GIT's image tokens): the text's
        # logits are the last ids.shape[1]
        logits = logits[:, -ids.shape[1] :]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().to(logits.device)
    )


def _hidden_states(output: Any) -> list[torch.Tensor]:
    """Every tower's `last_hidden_state`: the output's own, else those of the outputs it
    nests (a two-tower model's `text_model_output` and `vision_model_output`), with the
    output's own per-position `logits` where it has them beside nested towers (a
    vision-language masked LM: its text reaches only the logits)."""
    own = getattr(output, "last_hidden_state", None)
    if isinstance(own, torch.Tensor):
        return [own]
    found: list[torch.Tensor] = []
    values = output.values() if isinstance(output, dict) else ()
    for value in values:
        inner = getattr(value, "last_hidden_state", None)
        if isinstance(inner, torch.Tensor) and inner.is_floating_point():
            found.append(inner)
    logits = output.get("logits") if isinstance(output, dict) and found else None
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() >= 3:
        found.append(logits)
    return found


def projection_loss(output: Any, seed: int = 0) -> torch.Tensor:
    """For encoders without a head: a fixed random projection of every output position of
    the last hidden state (of each tower, for two-tower models), mean-squared, like a
    freshly initialised per-position head. Every position gets a gradient of the same
    nature, so ratios through depth mean what they mean for a language model (a loss on
    a pooled or class token alone reaches a few positions, and its gradient at the last
    block is tiny by construction)."""
    hidden = _hidden_states(output)
    if not hidden:
        first = first_tensor(output)
        hidden = [first] if first is not None else []
    if not hidden:
        raise UsageError(no_loss_line(output))
    total: torch.Tensor | None = None
    for h in hidden:
        d = h.shape[-1]
        gen = torch.Generator().manual_seed(seed + 7)
        proj = (torch.randn(d, 16, generator=gen) / d**0.5).to(h.device)
        term = (h.float() @ proj).square().mean()
        total = term if total is None else total + term
    assert total is not None
    return total


def no_loss_line(output: Any) -> str:
    """The refusal when an output holds no floating-point tensor (a codec encoder's
    integer codes): what it returned, and the two ways to scan it anyway."""
    items = output.items() if isinstance(output, dict) else [("output", output)]
    shown = [
        f"{k} {str(v.dtype).removeprefix('torch.')}"
        for k, v in items
        if isinstance(v, torch.Tensor)
    ][:3]
    what = f" (it returned {', '.join(shown)})" if shown else ""
    return (
        f"the model returned no floating-point tensor to compute a loss on{what}: measure "
        "its forward alone with --no-backward (backward=False), or pass loss_fn="
    )


def mean_square_loss(output: Any) -> torch.Tensor:
    t = first_tensor(output)
    if t is None:
        raise UsageError(no_loss_line(output))
    return t.float().square().mean()


def has_labels(batch: Batch) -> bool:
    """Whether the batch carries labels the model computes its own loss on: `labels`,
    or labels of a named kind (a TTS model's `duration_labels`, `spectrogram_labels`)."""
    return any(k == "labels" or k.endswith("_labels") for k in batch.kwargs)


def describe_loss(task: str, batch: Batch, caller: bool) -> str:
    """The objective `default_loss` uses on `batch`, in words (the report's `run.loss`)."""
    if caller:
        return "the caller's loss"
    if has_labels(batch):
        return "the model's own loss on random labels"
    if task == "causal-lm" and batch.token_ids is not None:
        return "next-token cross-entropy"
    if task == "encoder":
        return "a fixed random projection of every output position, mean-squared"
    return "mean square of the first output tensor"


def default_loss(task: str, vocab_size: int | None) -> Callable[[Any, Batch], torch.Tensor]:
    """The model's own loss when the batch carries labels (encoder-decoders), next-token
    cross-entropy for language models, a projection loss for encoders, else the mean
    square of the first output tensor (README, "pytest")."""

    def loss(output: Any, batch: Batch) -> torch.Tensor:
        own = getattr(output, "loss", None)
        if has_labels(batch) and isinstance(own, torch.Tensor) and own.dim() == 0:
            return own  # the model's own loss on the labels it was given (encoder-decoders)
        ids = batch.token_ids
        if task == "causal-lm" and ids is not None:
            logits = _logits(output)
            if logits is not None and logits.dim() == 3 and ids.dim() == 2:
                return next_token_loss(output, ids)
        if task == "encoder":
            return projection_loss(output)
        return mean_square_loss(output)

    return loss
