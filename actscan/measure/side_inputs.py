"""Inputs a forward needs beside its main input, from its signature and config.

Some models refuse to run on token ids alone although nothing about the data matters to
a scan: a document model needs a box per token (`bbox`: LayoutLM, LiLT, BROS, UDOP), a
multilingual adapter model a language (`lang_ids`: X-MOD, whose config lists
`languages` and names no default). Each is invented here from what the config says:

- **boxes**: one box per token, x0 ≤ x1 and y0 ≤ y1, with the config's `dim_bbox`
  coordinates (BROS's four corners, 8) else 4. Normalised floats in [0, 1] (BROS's
  sinusoids, UDOP's buckets) where the model runs on them, else integers below the
  config's `max_2d_position_embeddings` (LayoutLM's 0–1000 grid): a float box fed to
  an embedding table raises, an integer one given to a normalised model would run on a
  degenerate layout, so floats are probed first.
- **a language**: the first of the config's `languages`, one id per row, as the model
  itself does when a default language is set.
- **variance labels**: a FastSpeech-style TTS model's training forward raises without
  the labels of its variance adaptor. Each token lasts `FRAMES_PER_TOKEN` mel frames;
  the frames those durations give are random mels of the config's `num_mel_bins` (a
  whole number of its reduction factor), with a random pitch and energy per token.

Everything duck-types `model.config`; nothing imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actscan.measure.inputs import Batch, InputSource
from actscan.measure.vision_text import config_int, deep_config_int, forward_params, runs_on

__all__ = ["SIDE_INPUTS", "VARIANCE_LABELS", "variance_labels", "with_side_inputs"]

# the labels a variance-adaptor TTS model (FastSpeech 2) trains on: all, or it raises
VARIANCE_LABELS = ("duration_labels", "spectrogram_labels", "pitch_labels", "energy_labels")
SIDE_INPUTS = ("bbox", "lang_ids", *VARIANCE_LABELS)  # the keys this module may add
FRAMES_PER_TOKEN = 2  # each token's duration in spectrogram frames
DEFAULT_MELS = 80
DEFAULT_GRID = 1000  # LayoutLM's box coordinates: integers in [0, 1000]


def _ids(b: Batch) -> torch.Tensor | None:
    ids = b.token_ids
    return ids if ids is not None and ids.dim() == 2 else None


def boxes(config: Any, rows: int, seq: int, seed: int, index: int, *, grid: bool) -> torch.Tensor:
    """One random box per token (rows × seq × 4, or × 8 corners for `dim_bbox = 8`):
    normalised floats, or with `grid` integers below `max_2d_position_embeddings`."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index + 17)
    xs = torch.rand(rows, seq, 2, generator=gen).sort(dim=-1).values
    ys = torch.rand(rows, seq, 2, generator=gen).sort(dim=-1).values
    x0, x1, y0, y1 = xs[..., 0], xs[..., 1], ys[..., 0], ys[..., 1]
    corners = (x0, y0, x1, y0, x1, y1, x0, y1) if config_int(config, "dim_bbox") == 8 else ()
    box = torch.stack(corners or (x0, y0, x1, y1), dim=-1)
    if not grid:
        return box
    top = (config_int(config, "max_2d_position_embeddings") or DEFAULT_GRID + 1) - 1
    return (box * min(top, DEFAULT_GRID)).long()


def _language(config: Any) -> int | None:
    """0 (the first listed language) when the config lists languages and sets none as
    the default; None when the model needs no language id from us."""
    languages = getattr(config, "languages", None)
    if not isinstance(languages, list | tuple) or not languages:
        return None
    return 0 if getattr(config, "default_language", None) is None else None


def with_side_inputs(model: nn.Module, source: InputSource, seed: int) -> InputSource:
    """`source` with the side inputs the forward takes and the batches lack (boxes, a
    language id), or `source` itself when none is needed."""
    config: Any = getattr(model, "config", None)
    params = forward_params(model)
    first = source(0)
    ids = _ids(first)
    if config is None or ids is None or not first.kwargs:
        return source
    adders: list[Callable[[Batch, int], dict[str, torch.Tensor]]] = []
    if "bbox" in params and "bbox" not in first.kwargs:
        rows, seq = ids.shape
        floats = {**first.kwargs, "bbox": boxes(config, rows, seq, seed, 0, grid=False)}
        grid = not runs_on(model, floats)

        def add_boxes(b: Batch, i: int) -> dict[str, torch.Tensor]:
            t = _ids(b)
            if t is None:
                return {}
            return {"bbox": boxes(config, t.shape[0], t.shape[1], seed, i, grid=grid)}

        adders.append(add_boxes)
    language = _language(config)
    if "lang_ids" in params and "lang_ids" not in first.kwargs and language is not None:

        def add_language(b: Batch, i: int) -> dict[str, torch.Tensor]:
            t = _ids(b)
            return {} if t is None else {"lang_ids": torch.full((t.shape[0],), language)}

        adders.append(add_language)
    if set(VARIANCE_LABELS) <= params and not set(VARIANCE_LABELS) & set(first.kwargs):

        def add_labels(b: Batch, i: int) -> dict[str, torch.Tensor]:
            t = _ids(b)
            return {} if t is None else variance_labels(config, t.shape[0], t.shape[1], seed, i)

        adders.append(add_labels)
    if not adders:
        return source

    def wrapped(i: int) -> Batch:
        b = source(i)
        extra: dict[str, torch.Tensor] = {}
        for add in adders:
            extra.update(add(b, i))
        return Batch(args=b.args, kwargs={**b.kwargs, **extra})

    return wrapped


def variance_labels(
    config: Any, rows: int, seq: int, seed: int, index: int
) -> dict[str, torch.Tensor]:
    """The labels of a variance adaptor for `rows` × `seq` tokens: durations of
    `FRAMES_PER_TOKEN` frames each, random mels for the frames they give, a random pitch
    and energy per token (see the module's docstring)."""
    mels = deep_config_int(config, ("num_mel_bins",)) or DEFAULT_MELS
    factor = deep_config_int(config, ("reduction_factor",)) or 1
    frames = seq * FRAMES_PER_TOKEN
    gen = torch.Generator().manual_seed(seed * 100_003 + index + 2)
    return {
        "duration_labels": torch.full((rows, seq), FRAMES_PER_TOKEN, dtype=torch.long),
        "spectrogram_labels": torch.randn(rows, frames - frames % factor, mels, generator=gen),
        "pitch_labels": torch.randn(rows, seq, 1, generator=gen),
        "energy_labels": torch.randn(rows, seq, 1, generator=gen),
    }
