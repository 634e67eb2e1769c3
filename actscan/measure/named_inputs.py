"""Float inputs a forward requires that no modality names, built from their names.

A drafter or a denoiser takes embeddings or hidden states another model computes
(`noise_embeds`, `context_hidden_states`) rather than ids, images or audio: float
tensors rows × positions × width (a robot's `state`: rows × width). Their width is not
always the config's hidden width: hidden states of several of a target's layers come
concatenated, and the forward's first projection reads that wider width. So each
argument's widths are tried in turn, from the config (a field named after the
argument, `max_state_dim` for `state`; the hidden width) and from the input widths of
the model's own linear layers, and the first set one forward runs on is kept.
Nothing here imports transformers; it duck-types `model.config`.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actscan.measure.inputs import Batch
from actscan.measure.vision_text import config_int, required_params, text_config

__all__ = ["FLOAT_SUFFIXES", "float_args", "named_float_source", "widths_for"]

# argument names that mean a float tensor of some width (embeddings, hidden states)
FLOAT_SUFFIXES = ("embeds", "hidden_states", "states", "state")
NAMED_SEQ = 16  # positions of each invented float sequence when --seq-len names none
MAX_PROBES = 32  # width combinations tried before giving up (one forward each)
LINEAR_WIDTHS = 4  # distinct linear input widths tried past the config's


def float_args(model: nn.Module) -> list[str] | None:
    """The forward's required arguments when every one is, by its name, a float tensor
    (none annotated as an object of another class, a cache or a session), else None."""
    required = [r for r in required_params(model) if r not in ("self", "kwargs")]
    if not required or not all(r.endswith(FLOAT_SUFFIXES) for r in required):
        return None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    for name in required:
        annotation = params[name].annotation
        if isinstance(annotation, type) and not issubclass(annotation, torch.Tensor):
            return None
    return required


def widths_for(model: nn.Module, name: str) -> list[int]:
    """The widths argument `name` may have, most likely first: config fields named after
    it (`state` → `max_state_dim`, `state_dim`), the hidden width (the model's, else its
    text config's), then the input widths of its linear layers in module order."""
    config: Any = model.config  # a transformers config: its fields vary by family
    stem = name
    for suffix in FLOAT_SUFFIXES:
        stem = stem.removesuffix(suffix)
    words = [w for w in stem.split("_") if w] or [name.split("_")[-1]]
    named = [
        v
        for k, v in sorted(vars(config).items())
        if k.endswith(("_dim", "_size"))
        and any(w in k.split("_") for w in words)
        and config_int(config, k)
    ]
    hidden = config_int(config, "hidden_size", "d_model") or config_int(
        text_config(config), "hidden_size", "d_model"
    )
    linear = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    found = [*named, *([hidden] if hidden else [])]
    extra = [w for w in dict.fromkeys(linear) if w not in found][:LINEAR_WIDTHS]
    return list(dict.fromkeys(found + extra))


def _shapes(name: str, width: int, seq: int) -> list[tuple[int, ...]]:
    """Per-row shapes: one vector for a singular `state`, else a sequence of them."""
    if name.endswith("state") and not name.endswith("hidden_state"):
        return [(width,), (seq, width)]
    return [(seq, width)]


def named_float_source(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int | None,
    seed: int,
    runs: Callable[[dict[str, Any]], bool],
) -> tuple[Callable[[int], Batch], str] | None:
    """Random normal tensors for a forward whose required arguments are all float
    tensors by name (`float_args`), in the first widths `runs` (one forward, one row)
    accepts, and what was fed in words; None when the forward takes others or no
    combination runs."""
    args = float_args(model)
    if args is None:
        return None
    seq = seq_len or NAMED_SEQ
    options = [[s for w in widths_for(model, a) for s in _shapes(a, w, seq)] for a in args]
    for combo in itertools.islice(itertools.product(*options), MAX_PROBES):
        probe = {a: torch.randn(1, *s) for a, s in zip(args, combo, strict=True)}
        if runs(probe):
            chosen = dict(zip(args, combo, strict=True))
            break
    else:
        return None

    def source(i: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        return Batch(kwargs={a: torch.randn(batch, *s, generator=gen) for a, s in chosen.items()})

    return source, "random normal; widths from the config and the model's own layers"
