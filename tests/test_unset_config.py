"""A model that fails on a config field its checkpoints set and the folder leaves unset: the
model-error line names the field (`unset_config_fields`, `missing_config_field`), planted
in tiny modules and on transformers' own DBRX, ESM and Qwen3-Omni thinker."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from actscan.measure.inputs import Batch
from actscan.measure.prepare import call_model, model_error_line

ROOT = Path(__file__).resolve().parent.parent


class _Config:
    """A config as actscan sees one: plain fields, sub-configs with `to_dict`."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class _Clamped(nn.Module):
    """Clamps at a bound its __init__ copies from the attention config (DBRX's shape)."""

    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(4, 4)
        self.bound = config.attn_config.clip_qkv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).clamp(min=None, max=self.bound)


def _line(model: nn.Module, **kwargs: Any) -> str:
    with pytest.raises(Exception) as caught:
        call_model(model, Batch(kwargs=kwargs))
    line = model_error_line(caught.value)
    assert line is not None
    return line


def test_a_none_the_module_copied_from_its_config_is_named() -> None:
    """`self.bound = attn_config.clip_qkv` left None reaches clamp: the line names the
    sub-config's field (the one set), not the module's attribute, and no other None
    field (head_dim is None too, never read)."""
    config = _Config(attn_config=_Config(clip_qkv=None), head_dim=None, hidden_size=4)
    line = _line(_Clamped(config), x=torch.randn(2, 4))
    assert "attn_config.clip_qkv = None" in line and "set it in config.json" in line
    assert "head_dim" not in line
    config.attn_config.clip_qkv = 8.0
    call_model(_Clamped(config), Batch(kwargs={"x": torch.randn(2, 4)}))  # now it runs


class _Windowed(nn.Module):
    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = getattr(self.config.text_config, "sliding_window", None)
        if window is None:
            raise ValueError("Could not find a `sliding_window` argument in the config")
        if self.config.vision_start_token_id:  # a field the config class lacks
            pass
        return self.proj(x)


def test_a_field_the_error_names_and_one_the_config_lacks_are_named() -> None:
    """The error names `sliding_window`, which the text config leaves None; with it set,
    the forward asks the config for a field it does not have (AttributeError on the
    config): both name the field to set."""
    config = _Config(text_config=_Config(sliding_window=None))
    line = _line(_Windowed(config), x=torch.randn(2, 4))
    assert "text_config.sliding_window = None" in line
    config.text_config.sliding_window = 8
    line = _line(_Windowed(config), x=torch.randn(2, 4))
    assert "its config has no vision_start_token_id: set it in config.json" in line


def test_an_error_of_another_cause_names_no_field() -> None:
    """A shape error with None fields in the config (never read) adds nothing."""
    config = _Config(attn_config=_Config(clip_qkv=8.0), pad_token_id=None)
    line = _line(_Clamped(config), x=torch.randn(2, 5))
    assert "config" not in line.split(": ", 1)[1]


@pytest.mark.parametrize(
    ("model_type", "unset", "named"),
    [
        ("dbrx", {"attn_config": {"clip_qkv": None}}, "attn_config.clip_qkv = None"),
        ("esm", {"pad_token_id": None}, "pad_token_id = None"),
        ("qwen3_omni_moe_thinker", None, "its config has no vision_start_token_id"),
    ],
)
def test_transformers_models_name_the_field_their_checkpoints_set(
    model_type: str, unset: dict[str, Any] | None, named: str
) -> None:
    """transformers' DBRX clamps q, k, v at `clip_qkv` (default None), ESM counts
    positions from `pad_token_id` (default None, through `self.padding_idx`), the
    Qwen3-Omni thinker reads a `vision_start_token_id` its config class no longer
    declares: the scan of such a folder fails in one line naming the field."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT))
    from actscan import scan
    from benchmarks import families

    saved = families.OVERRIDES[model_type]
    families.OVERRIDES[model_type] = {} if unset is None else copy.deepcopy(saved)
    try:
        if unset is not None:
            families._merge(families.OVERRIDES[model_type], unset)
        model = families.build(model_type, families.model_types()[model_type])
    finally:
        families.OVERRIDES[model_type] = saved
    with pytest.raises(Exception) as caught:
        scan(model, batch=2, seq_len=8)
    line = model_error_line(caught.value)
    assert line is not None and named in line and "set it in config.json" in line


class _BatchBug(nn.Module):
    """Views a per-position table with the batch size (TVP's column embeddings): any
    batch of more than one row fails, one row runs."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table(torch.arange(x.shape[1])).view(x.shape[0], x.shape[1], 8)
        return x + table


def test_a_batch_that_fails_where_one_row_runs_asks_for_batch_1() -> None:
    """Once the run unwound (`one_row_hint` around it), the first row alone runs: the
    line says so and names --batch 1; a model that fails on one row too gets no hint."""
    from actscan.measure.prepare import one_row_hint

    model = _BatchBug()
    with pytest.raises(RuntimeError) as caught, one_row_hint(model):
        call_model(model, Batch(kwargs={"x": torch.randn(2, 4, 8)}))
    line = model_error_line(caught.value)
    assert line is not None and "runs on one row, not on 2" in line and "--batch 1" in line
    with pytest.raises(IndexError) as caught, one_row_hint(model):
        call_model(model, Batch(kwargs={"x": torch.randn(2, 5, 8)}))  # 5 positions: never
    line = model_error_line(caught.value)
    assert line is not None and "one row" not in line


class _TrainOnly(nn.Module):
    """Fails in training mode only, at any batch (FastSpeech2 asks for labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise ValueError("All labels must be provided to run in training mode.")
        return self.proj(x)


def test_a_model_failing_in_training_alone_is_no_batching_bug() -> None:
    """One row runs in eval mode, but so does the whole batch: no --batch 1 hint."""
    from actscan.measure.prepare import one_row_hint

    model = _TrainOnly().train()
    with pytest.raises(ValueError) as caught, one_row_hint(model):
        call_model(model, Batch(kwargs={"x": torch.randn(2, 8)}))
    line = model_error_line(caught.value)
    assert line is not None and "one row" not in line


@pytest.mark.slow
def test_tvp_is_refused_with_batch_1_and_runs_on_it() -> None:
    """transformers' TVP views its column embeddings with the batch size: a batch of 2
    fails with the hint, and the scan at batch 1 runs."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT))
    from actscan import scan
    from benchmarks import families

    model = families.build("tvp", families.model_types()["tvp"])
    with pytest.raises(Exception) as caught:
        scan(model, batch=2, seq_len=8)
    line = model_error_line(caught.value)
    assert line is not None and "scan with --batch 1" in line
    assert scan(model, batch=1, seq_len=8).findings is not None
