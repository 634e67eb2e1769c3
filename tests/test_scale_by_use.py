"""What the forward does with a tensor decides which scale rule judges it.

init-scale's fan-in rule is for weights multiplied into unit-variance activations; a
Fourier-feature matrix read through sin/cos (SAM's positional matrix) and a weight
contracted against L2-normalised rows (SwiftFormer's w_g) are not that. logit-scale's
"head" is a softmax's input only when it is the model's output and no norm divides its
scale out (AIMv2's contrastive projections, OneFormer's task MLP). A max|x| at exactly
the dtype's largest finite value is a mask's fill constant (LightGlue), not overflow. A
channels-first LayerNorm's gain is read over the axis it normalises (SAM's mask
embedding). Each case is planted beside the one the check must still catch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actscan.layout.usage import measure_usage, probe_gain
from actscan.records import CheckId, Finding, Severity
from actscan.report.report import Report
from actscan.run import scan


def of(report: Report, check: CheckId) -> list[Finding]:
    return [f for f in report.findings if f.check == check]


def loud(report: Report, check: CheckId) -> list[Finding]:
    return [f for f in of(report, check) if f.severity is not Severity.INFO]


# --------------------------------------------------------------------------- init-scale


class Fourier(nn.Module):
    """Random Fourier features of 2-D points (SAM's prompt encoder): (2x − 1) @ B, then
    sin/cos of 2π times it; `periodic=False` feeds the product to a Linear instead."""

    def __init__(self, periodic: bool) -> None:
        super().__init__()
        self.periodic = periodic
        self.freq = nn.Parameter(30.0 * torch.randn(2, 32))
        self.out = nn.Linear(64 if periodic else 32, 16)

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        z = (2 * xy - 1) @ self.freq
        if self.periodic:
            z = 2 * math.pi * z
            z = torch.cat([torch.sin(z), torch.cos(z)], dim=-1)
        return self.out(z)


def test_a_fourier_feature_matrix_is_info_and_the_same_matrix_into_a_linear_fires() -> None:
    xy = torch.rand(4, 8, 2)
    assert measure_usage(Fourier(True), (xy,), {}).periodic("freq")
    fourier = scan(Fourier(True), inputs=xy, backward=False)
    assert not loud(fourier, CheckId.INIT_SCALE)
    info = [f for f in of(fourier, CheckId.INIT_SCALE) if "sin/cos" in f.message]
    assert len(info) == 1 and "freq" in info[0].message
    plain = loud(scan(Fourier(False), inputs=xy, backward=False), CheckId.INIT_SCALE)
    assert len(plain) == 1 and plain[0].severity is Severity.ERROR
    assert plain[0].message.startswith("freq (1 matrix)")


class Additive(nn.Module):
    """SwiftFormer's efficient additive attention: q F.normalize'd, then q @ w_g."""

    def __init__(self, std: float, normalize: bool = True, d: int = 64) -> None:
        super().__init__()
        self.normalize, self.d = normalize, d
        self.to_q = nn.Linear(d, d)
        self.w_g = nn.Parameter(std * torch.randn(d, 1))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.to_q(x)
        q = F.normalize(q, dim=-1) if self.normalize else q / math.sqrt(self.d)
        a = (q @ self.w_g * self.d**-0.5).softmax(dim=1)
        return self.out((a * q).sum(1, keepdim=True) * q)


def test_a_weight_on_unit_norm_rows_is_held_to_std_1() -> None:
    x = torch.randn(4, 8, 64)
    use = measure_usage(Additive(1.0), (x,), {}).role("w_g")
    assert use is not None and use.unit_input and use.fan_in == 64
    assert not loud(scan(Additive(1.0), inputs=x, backward=False), CheckId.INIT_SCALE)
    big = loud(scan(Additive(10.0), inputs=x, backward=False), CheckId.INIT_SCALE)
    assert len(big) == 1 and "unit L2 norm" in big[0].message
    assert big[0].value == pytest.approx(10.0, rel=0.3)
    # the same std 1 on rows of unit RMS entries (not unit norm): the fan-in rule holds
    x_rms = loud(scan(Additive(1.0, normalize=False), inputs=x, backward=False), CheckId.INIT_SCALE)
    assert len(x_rms) == 1 and "w_g" in x_rms[0].message and "unit L2" not in x_rms[0].message


class ChannelsFirstLN(nn.LayerNorm):
    """SAM's LayerNorm(data_format='channels_first'): normalises dim 1 of (N, C, H, W)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_a_channels_first_layernorm_reads_its_true_gain() -> None:
    ln = ChannelsFirstLN(4)
    for gain in (1.0, 3.0):
        with torch.no_grad():
            ln.weight.fill_(gain)
        g = probe_gain(ln, ln.weight, (1, 4, 6, 6))
        assert g is not None
        assert g.mean().item() == pytest.approx(gain, abs=1e-4)
        assert g.std().item() < 1e-4
    bn = nn.BatchNorm2d(4).train()  # per channel over batch and space: still read so
    with torch.no_grad():
        bn.weight.fill_(2.0)
    g = probe_gain(bn, bn.weight, (1, 4, 6, 6))
    assert g is not None and g.mean().item() == pytest.approx(2.0, abs=1e-3)


# --------------------------------------------------------------------------- logit-scale


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Tower(nn.Module):
    """A block stack, then a Linear of std 1 over fan-in 32 (outputs of std ~5.7 over 64):
    `end` says what follows it: nothing (logits), an L2 norm (a contrastive embedding),
    or a module reading it (an inner MLP's last layer)."""

    def __init__(self, end: str) -> None:
        super().__init__()
        self.end = end
        self.blocks = nn.ModuleList(Block(32) for _ in range(4))
        self.reader = nn.Linear(64, 32)
        self.head = nn.Linear(32, 64)
        nn.init.normal_(self.head.weight, std=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        z = self.head(x)
        if self.end == "l2":
            return z / z.norm(dim=-1, keepdim=True)
        return self.reader(z) if self.end == "read" else z


@pytest.mark.parametrize("end", ["l2", "read"])
def test_a_head_no_softmax_reads_is_info_and_true_logits_still_fire(end: str) -> None:
    x = torch.randn(4, 16, 32)
    logits = loud(scan(Tower("logits"), inputs=x, backward=False), CheckId.LOGIT_SCALE)
    assert len(logits) == 1 and logits[0].layers == ("head",)
    report = scan(Tower(end), inputs=x, backward=False)
    assert not loud(report, CheckId.LOGIT_SCALE)
    info = of(report, CheckId.LOGIT_SCALE)
    why = "into a norm" if end == "l2" else "not the model's output: reader"
    assert len(info) == 1 and why in info[0].message


# --------------------------------------------------------------------------- overflow


class MaskedBlock(Block):
    """A block that fills padded rows with `fill` (LightGlue's match assignment:
    similarity.masked_fill(mask == 0, finfo.min))."""

    def __init__(self, d: int, fill: float) -> None:
        super().__init__(d)
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        pad = torch.zeros(y.shape[:-1], dtype=torch.bool)
        pad[:, -2:] = True
        return y.masked_fill(pad[..., None], self.fill)


class Masked(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([*(Block(32) for _ in range(3)), MaskedBlock(32, fill)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_fill_constant_is_no_overflow_and_a_value_near_the_ceiling_still_warns() -> None:
    x = torch.randn(2, 8, 32)
    filled = scan(Masked(torch.finfo(torch.float32).min), inputs=x, backward=False)
    assert not loud(filled, CheckId.OVERFLOW)
    assert not loud(filled, CheckId.MASSIVE_ACTIVATIONS)
    assert any("fill constant" in f.message for f in of(filled, CheckId.OVERFLOW))
    grown = scan(Masked(-3.0e38), inputs=x, backward=False)
    assert len(loud(grown, CheckId.OVERFLOW)) == 1
    assert loud(grown, CheckId.MASSIVE_ACTIVATIONS)


# --------------------------------------------------------------------------- no host sync


class _ThreeReads(nn.Module):
    """Each use the watch decides from values: a table mixed by convex weights, a weight
    on unit rows, an output divided by its own L2 norm; and a signed mix (a matmul)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 32))
        self.w_g = nn.Parameter(torch.randn(32, 1))
        self.signed = nn.Parameter(torch.randn(32, 32))
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = torch.softmax(x[..., :16], dim=-1) @ self.table  # convex rows @ table
        gate = F.normalize(mix, dim=-1) @ self.w_g  # unit rows @ w_g
        z = self.proj(mix * gate)
        z = z / z.norm(dim=-1, keepdim=True)  # the L2 norm written out
        return torch.matmul(x, self.signed) + z


def test_the_usage_watch_reads_values_after_the_pass_not_inside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its value-dependent decisions stay on the device until the pass ends (a host read
    per call would sync a GPU once per contraction), and decide as before."""
    from actscan.layout.usage import watch_usage
    from actscan.measure.hooks import HookSet

    model, x = _ThreeReads(), torch.randn(2, 8, 32)

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("host read inside the watched pass")

    with HookSet() as hooks, watch_usage(model, hooks) as usage, monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, boom)
        model(x)
    got = usage()
    assert got.role("table") == _use("embedding")
    w_g = got.role("w_g")
    assert w_g is not None and w_g.op == "matmul" and w_g.unit_input and w_g.fan_in == 32
    signed = got.role("signed")
    assert signed is not None and signed.op == "matmul" and not signed.unit_input
    assert got.normed("proj.weight") and not got.normed("signed")


def _use(op: str) -> object:
    from actscan.layout.usage import ParamUse

    return ParamUse(op)
