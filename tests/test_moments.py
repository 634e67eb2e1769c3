"""The one Chan merge (`merge_moments`) against a direct fp64 computation of the whole."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actscan.measure.moments import Moments, merge_moments

F64 = torch.float64


def part_moments(x: torch.Tensor) -> Moments:
    """(n, mean, M2) of each column of x (rows: values), as the recorder forms a part's."""
    n = torch.full((x.shape[1],), float(x.shape[0]), dtype=F64)
    mean = x.sum(0) / n.clamp_min(1)
    m2 = ((x - mean) ** 2).sum(0)
    return n, mean, m2


def merged(x: torch.Tensor, cuts: list[int]) -> Moments:
    """Moments of x's rows split at `cuts` (empty parts included), merged left to right."""
    bounds = [0, *sorted(cuts), x.shape[0]]
    parts = [part_moments(x[a:b]) for a, b in itertools.pairwise(bounds)]
    out = parts[0]
    for p in parts[1:]:
        out = merge_moments(out, p)
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 200),
    cols=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    loc=st.sampled_from([0.0, 1.0, -3e3, 1e6]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    data=st.data(),
)
def test_any_split_merges_to_the_whole(
    rows: int, cols: int, seed: int, loc: float, scale: float, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen, dtype=F64) * scale + loc).to(F64)
    cuts = data.draw(st.lists(st.integers(0, rows), max_size=6))
    n, mean, m2 = merged(x, cuts)
    # the whole, directly
    var, want_mean = torch.var_mean(x, dim=0, correction=0)
    assert n.tolist() == [float(rows)] * cols
    # fp64 rounding: each x − mean carries ~eps·|loc| against deviations of ~scale
    eps = torch.finfo(F64).eps
    rel = 1e-11 + 64 * eps * abs(loc) / scale
    for j in range(cols):
        assert abs(mean[j].item() - want_mean[j].item()) <= 1e-12 * max(abs(loc), scale)
        want_m2 = var[j].item() * rows
        assert math.isclose(m2[j].item(), want_m2, rel_tol=rel, abs_tol=1e-12 * scale**2)


def test_an_empty_part_changes_nothing_and_inputs_stay_unwritten() -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 5.0], [4.0, 0.5]], dtype=F64)
    a = part_moments(x)
    copies = [t.clone() for t in a]
    zeros = torch.zeros(2, dtype=F64)
    # an empty part whose mean is not a number (0/0 upstream) must not leak into the merge
    empty = (zeros, torch.full((2,), math.nan, dtype=F64), zeros)
    fresh = (zeros, zeros, zeros)  # a running accumulator before its first part
    for got in (merge_moments(a, empty), merge_moments(fresh, a)):
        for g, w in zip(got, a, strict=True):
            assert torch.equal(g, w)
    for t, c in zip(a, copies, strict=True):
        assert torch.equal(t, c)
    # two empty parts stay empty (no 0/0)
    n, mean, m2 = merge_moments(fresh, fresh)
    assert n.tolist() == mean.tolist() == m2.tolist() == [0.0, 0.0]
