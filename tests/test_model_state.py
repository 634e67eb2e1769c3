"""scan() gives the caller's model back bit for bit (actscan.measure.state): every
parameter (its storage, values, `.grad`, requires_grad), every buffer (the same objects,
the same bits), every module attribute (modes, dropout rates, counters, cached tensors)
and the torch random stream, after a plain run, after optimizer steps, after a cast to
another dtype, and when the model raises part-way.

The zoo holds modules that change state in their forward, the way real models do:
spectral norm (u/v buffers, the `weight` attribute it recomputes), an EMA buffer, a step
counter (a buffer and a Python int), BatchNorm with momentum=None (a cumulative average),
a module caching its last input (a buffer it re-assigns, an attribute it adds) and
drawing random numbers, and dropout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from actscan import scan

D, ROWS = 8, 4


class SpectralNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.spectral_norm(nn.Linear(D, D))  # power iteration per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Ema(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.calls += 1
        return self.lin(x)


class CumulativeNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


class Cache(nn.Module):
    """Keeps its last input: a registered buffer re-assigned (a new tensor, another shape)
    and a plain attribute that did not exist before; draws noise from the global stream."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("last_in", torch.zeros(1, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_in = x.detach().clone()
        self.seen = x.detach()
        self.noise = torch.rand(())
        return self.lin(x) + 0.0 * self.noise


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(0.25)
        self.attn_pdrop = 0.1  # a rate held as a plain attribute, as HF attention modules do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


ZOO = {
    "spectral": SpectralNormed,
    "ema": Ema,
    "counter": Counter,
    "bn-cumulative": CumulativeNorm,
    "cache": Cache,
    "dropout": Dropped,
}


class Trip(Exception):
    pass


class Net(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ZOO[k]() for k in kinds)
        self.head = nn.Linear(D, D)
        self.raise_at: int | None = None
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        for block in self.blocks:
            x = x + block(x)
        if self.raise_at is not None and self.forwards >= self.raise_at:
            raise Trip(f"forward {self.forwards}")
        return self.head(x)


def build(kinds: list[str]) -> Net:
    torch.manual_seed(len(kinds))
    net = Net(kinds)
    with torch.no_grad():  # warm state: the caller has run the model before
        net(torch.randn(ROWS, D))
    net.train()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()  # a mixed mode the run must not keep
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].requires_grad_(False)
    return net


def bits(t: torch.Tensor) -> tuple[Any, ...]:
    """What the tensor is, to the bit: dtype, device, shape and its bytes."""
    flat = t.detach().reshape(-1).contiguous()
    return t.dtype, t.device, tuple(t.shape), bytes(flat.view(torch.uint8).cpu().numpy())


def state(model: nn.Module) -> dict[str, Any]:
    """Every module's attributes (tensors by identity and bits), parameters (storage,
    bits, .grad, requires_grad), buffers (identity and bits), and the RNG."""
    out: dict[str, Any] = {"rng": bytes(torch.get_rng_state().numpy())}
    for name, m in model.named_modules():
        attrs: dict[str, Any] = {}
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(v, torch.Tensor):
                attrs[k] = (id(v), bits(v))
            elif isinstance(v, dict):
                attrs[k] = (id(v), tuple(v))  # hook tables: the same, with the same hooks
            else:
                attrs[k] = repr(v)
        params = {
            k: (
                id(p),
                p.data.data_ptr(),
                bits(p),
                p.requires_grad,
                None if p.grad is None else (id(p.grad), bits(p.grad)),
            )
            for k, p in m._parameters.items()
            if p is not None
        }
        buffers = {k: (id(b), bits(b)) for k, b in m._buffers.items() if b is not None}
        out[name] = (type(m), attrs, params, buffers)
    return out


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after.keys() == before.keys()
    for key in before:
        assert after[key] == before[key], f"{key or 'the root module'} changed"


def features(i: int) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(i))


def run(net: Net, steps: int, dtype: torch.dtype | None) -> None:
    scan(
        net,
        features,
        lambda out: out.float().square().mean(),
        steps=steps,
        dtype=dtype,
        lr=1e-2,
        batches=2,
    )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(ZOO)), min_size=1, max_size=4),
    steps=st.sampled_from([0, 2]),
    dtype=st.sampled_from([None, torch.float64]),
)
@example(kinds=sorted(ZOO), steps=0, dtype=None)
@example(kinds=sorted(ZOO), steps=2, dtype=None)
@example(kinds=sorted(ZOO), steps=2, dtype=torch.float64)
def test_scan_gives_every_piece_of_state_back(
    kinds: list[str], steps: int, dtype: torch.dtype | None
) -> None:
    net = build(kinds)
    before = state(net)
    run(net, steps, dtype)
    assert_same(before, state(net))


# The root's forwards in one scan of the whole zoo (no repeated blocks: no layout
# self-check): 1-2 the recorded batches (the at-init usage rides on the first), then per
# step its probe and its batch. From `raise_at` on, every forward raises.
@pytest.mark.parametrize(
    ("steps", "raise_at"),
    [(0, 1), (0, 2), (2, 3), (2, 6)],
    ids=["first-forward", "recorded-pass", "first-step", "a-later-step"],
)
def test_state_comes_back_when_the_model_raises(steps: int, raise_at: int) -> None:
    net = build(sorted(ZOO))
    net.forwards, net.raise_at = 0, raise_at
    before = state(net)
    with pytest.raises(Trip):
        run(net, steps, None)
    assert_same(before, state(net))


def test_the_zoo_does_change_state_in_its_forward() -> None:
    """The property above is not vacuous: outside scan() the same runs change the model."""
    net = build(sorted(ZOO)).train()
    before = state(net)
    net(features(0))
    after = state(net)
    changed = {k for k in before if before[k] != after[k]}
    # the noise, BatchNorm's statistics, the cache, the counter, the EMA, spectral norm's u
    assert {"rng", "blocks.0.bn", "blocks.1", "blocks.2", "blocks.4", "blocks.5.lin"} <= changed
