"""Chan's parallel merge of moments: the one place two partial (count, mean, M2) meet.

Why one helper: the recorder merges each batch into its running moments, the attention
probes merge each call, and a distributed run merges the ranks' moments (the recorder's
and the probes' accumulators, the parameters' shards). Each once had its own copy of the
formula, with its own order of additions and its own guard for an empty part; one
function gives every merge the same rounding and the same edge cases.

M2 = Σ (x − mean)². Merging (n_a, mean_a, M2_a) with (n_b, mean_b, M2_b) (Chan, Golub &
LeVeque, 1979) never forms Σx² − n·mean², so a large mean does not cancel the variance.
"""

from __future__ import annotations

import torch

__all__ = ["Moments", "merge_moments"]

# (count, mean, M2), each a tensor of the same shape: one entry per merged quantity
Moments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of the union of two disjoint parts, elementwise over the tensors.

    Pure (new tensors; `a` and `b` are not written). Counts are whole numbers. An empty
    `b` (count 0) leaves `a` as it is, whatever b's mean holds (0/0 upstream); an empty
    `a` holds zeros (a fresh accumulator) and gives `b`.
    """
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = torch.where(n_b > 0, mean_b - mean_a, torch.zeros_like(mean_b))
    w = n_b / n.clamp_min(1)  # n_b / n, 0 where both parts are empty
    return n, mean_a + delta * w, m2_a + (m2_b + delta.square() * n_a * w)
