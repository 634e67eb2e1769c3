"""Healthy real families get no warning at step 0 or over their first 10 steps.

transformers' own Llama / Mistral / Qwen2 (their `_init_weights`, initializer_range 0.02)
at 12 layers, trained 10 AdamW steps on real text (the ground truth's byte tokens of the
Python standard library) at lr 3e-4 with no warmup: no finding above info, step 0 or
steps. The same model at lr 0.1, which fails on the ground truth, is flagged, so the
quiet is the checks' verdict, not their absence. benchmarks/healthy_inits.py records the
12/24/32-layer scans in benchmarks/results/healthy-inits.json.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import healthy_inits  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "healthy-inits.json"
USUAL_LR = healthy_inits.LR


def loud(row: dict) -> list[tuple[str, str]]:
    return [(f["check"], f["severity"]) for f in row["findings"] if f["severity"] != "info"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_12_layer_llama_is_quiet_over_10_steps_at_its_usual_lr() -> None:
    """The cheapest config that still tests the claim: 12 layers (the real depth), width
    128, the full lr from the first update."""
    row = healthy_inits.measure("llama", 12, 128, warmup=0, lr=USUAL_LR)
    assert not loud(row), row["findings"]
    assert row["loss"][1] < row["loss"][0] - 0.5  # it learns: the steps were taken
    assert any(f["check"] == "sqrt-growth" for f in row["findings"])  # reported, at info


@pytest.mark.slow
@pytest.mark.parametrize("family", healthy_inits.FAMILIES)
def test_real_families_at_12_layers_are_quiet_and_a_failing_lr_is_not(family: str) -> None:
    """Width 256 with each family's own shape (GQA, MLP ratio, tied embeddings), lr 3e-4
    without warmup: quiet; lr 0.1 on the same model (it fails on the ground truth):
    update-size, attn-logit-growth and logit-drift warn or worse."""
    row = healthy_inits.measure(family, 12, 256, warmup=0, lr=USUAL_LR)
    assert not loud(row), row["findings"]
    bad = healthy_inits.measure(family, 12, 256, warmup=0, lr=0.1)
    assert {"update-size", "attn-logit-growth", "logit-drift"} <= {c for c, _ in loud(bad)}


def test_the_recorded_scans_cover_the_claim_and_have_no_warning() -> None:
    """healthy-inits.json: the three families at 12, 24 and 32 layers, each at lr 3e-4
    with the families' 2000-step warmup and with none: no warn or error anywhere."""
    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    rows = [r for r in data["rows"] if r["lr"] == USUAL_LR]
    assert {(r["family"], r["depth"]) for r in rows} >= {
        (f, d) for f in healthy_inits.FAMILIES for d in (12, 24, 32)
    }
    assert {r["warmup"] for r in rows} == {0, 2000}
    assert all(not loud(r) for r in rows), [(r["family"], r["depth"], loud(r)) for r in rows]
