"""The standing breadth matrix (issue 22): every model type this transformers lists in its
auto mappings, built tiny with the library's own init and scanned (benchmarks/families.py
derives the configs and runs each row; docs/families.md publishes the result).

Per type: exit 0/1/2 only (a crash is exit 3); on healthy init no warn/error finding and
every block's layout verified, unless benchmarks/families.py's ARGUED table argues the
finding true. Types that do not clean up yet are listed with their cause in
tests/breadth_baseline.json: they are expected failures (xfail, not strict, so a fix shows
as XPASS and the entry is then removed by `python benchmarks/families.py --baseline`). A
type not in the baseline that is not clean is a regression."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import families  # noqa: E402

BASELINE: dict[str, str] = json.loads((ROOT / "tests" / "breadth_baseline.json").read_text())
TYPES = families.model_types()
# `make test` runs every SAMPLE-th type (the whole matrix is ~10 min of one core, twice
# the suite); ACTSCAN_BREADTH=all runs them all, as `benchmarks/families.py` does.
SAMPLE = 1 if os.environ.get("ACTSCAN_BREADTH") == "all" else 10
SAMPLED = sorted(TYPES)[::SAMPLE]


def test_the_matrix_covers_at_least_150_types() -> None:
    assert len(TYPES) >= 150
    assert set(BASELINE) <= set(TYPES), sorted(set(BASELINE) - set(TYPES))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SAMPLED)
def test_each_type_runs_clean(model_type: str, request: pytest.FixtureRequest) -> None:
    if model_type in BASELINE:
        request.applymarker(pytest.mark.xfail(reason=BASELINE[model_type], strict=False))
    row = families.run_one(model_type, TYPES[model_type])
    if row.status == "needs-package":  # an optional package this environment lacks
        pytest.skip(row.reason)
    assert row.exit in (None, 0, 1, 2), (row.status, row.reason)
    assert row.status == "clean", (row.status, row.layout, row.findings or row.reason)


def test_tiny_configs_are_tiny_and_keep_what_configs_derive() -> None:
    llama = families.tiny_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.vocab_size) == (64, 4, 512)
    assert llama.num_attention_heads * llama.head_dim == 64
    # derived fields are derived again from the shrunk values, not kept at full size
    ds = families.tiny_config("deepseek_v3")
    assert ds.qk_head_dim == ds.qk_nope_head_dim + ds.qk_rope_head_dim
    assert ds.num_key_value_heads == ds.num_attention_heads  # 128/128 at full size
    # Mamba-2 validates heads × head_dim = expand × hidden
    m2 = families.tiny_config("mamba2")
    assert m2.num_heads * m2.head_dim == m2.expand * m2.hidden_size
    # a vision-language model's image token moves inside the shrunk text vocabulary
    llava = families.tiny_config("llava")
    assert llava.image_token_index < llava.text_config.vocab_size


@pytest.mark.parametrize("model_type", ["llama", "clip", "vit"])
def test_a_sample_row_runs_clean(model_type: str) -> None:
    """The fast suite's sample of the matrix: a language model, a two-tower model, a
    vision backbone, each through the same row function."""
    row = families.run_one(model_type, TYPES[model_type])
    assert row.status == "clean", (row.status, row.layout, row.findings or row.reason)
    assert row.inputs and row.loss and row.layout.startswith("verified")
