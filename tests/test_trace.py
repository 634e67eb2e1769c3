"""The first operation that breaks (actscan/measure/trace.py, `--trace`).

Planted cases: an fp16 overflow inside one module that a later operation hides from the
hooks, the same in the backward (a custom Function, and sqrt's gradient at 0), a NaN from
log of a negative, 0·inf; a tiny transformers GPT-2 and the built-in family with one
weight scaled to overflow fp16; a `module:callable` target; a compiled model. Each names
the aten operation, module and line, checked against the test's own source lines.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

from actscan import scan
from actscan.api import scan_target
from actscan.measure import trace as trace_mod
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.records import CheckId, Severity
from actscan.render.formats import to_markdown
from actscan.report.report import Report
from actscan.report.schema import load_schema
from actscan.settings import Settings

HERE = Path(__file__).name


def _line(fn: object, text: str) -> int:
    """The file line number of the line holding `text` in `fn`'s source."""
    lines, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return start + next(i for i, ln in enumerate(lines) if text in ln)


class Hidden(nn.Module):
    """An intermediate ×1e5 that overflows fp16, brought back in range by tanh: the
    module's output (and every hook) looks fine."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * 1e5
        return self.fc2(torch.tanh(h))


class Boost(torch.autograd.Function):
    """Identity forward; its backward scales the gradient past fp16's range."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 1e8


class Boosted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = Boost.apply(self.fc1(x))
        return self.fc2(h)


class RootOfZero(nn.Module):
    """‖0‖ = sqrt(0) is finite; its gradient 1/(2·sqrt(0)) is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = (x * 0).pow(2).sum(-1, keepdim=True).sqrt()
        return x + r


class LogNeg(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100.0)


class ZeroInf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.exp(x * 1000.0)
        return big * 0.0


class Net(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), inner, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _net(inner: nn.Module) -> Net:
    torch.manual_seed(0)
    return Net(inner)


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def _where(fn: object, text: str) -> str:
    return f"{HERE}:{_line(fn, text)}"


def test_forward_overflow_inside_one_module_is_named() -> None:
    # forward only: in the backward, fc1's output gradient is ×1e5 (and ×4096 loss scale)
    # wherever tanh is not saturated, which may overflow too, depending on fp16 rounding
    report = scan(_net(Hidden()), X, dtype="fp16", trace=True, backward=False)
    assert all(r.nonfinite == 0 for r in report.layers)  # the hooks see nothing wrong
    tr = report.trace
    assert tr is not None and tr.reason == "asked" and tr.first is not None
    op = tr.first
    assert (op.op, op.module, op.phase) == ("aten.mul.Tensor", "b", "forward")
    assert op.source is not None and op.source.endswith(
        f"{_where(Hidden.forward, 'h * 1e5')} in forward"
    )
    assert op.code == "h = h * 1e5"
    # its input is fc1's output: finite, and ×1e5 of it is beyond 65504
    (inp,) = op.inputs
    assert inp.nonfinite == 0 and inp.max_abs is not None and inp.max_abs * 1e5 > 65504
    warn = [f for f in report.findings if f.check == CheckId.OVERFLOW]
    assert [f.severity for f in warn] == [Severity.WARN]
    assert "aten.mul.Tensor in b" in warn[0].message and "h = h * 1e5" in warn[0].message


def test_fp32_sees_no_overflow_there() -> None:
    """The same model in fp32: ×1e5 is in range, nothing breaks; the peak is that mul."""
    report = scan(_net(Hidden()), X, trace=True)
    tr = report.trace
    assert tr is not None and tr.first is None and tr.ceiling is None
    assert tr.peak is not None and tr.peak.op == "aten.mul.Tensor" and tr.peak.module == "b"
    assert not [f for f in report.findings if f.check == CheckId.OVERFLOW]


def test_backward_overflow_in_a_custom_function() -> None:
    report = scan(_net(Boosted()), X, dtype="fp16", trace=True)
    op = report.trace.first if report.trace else None
    assert op is not None
    assert (op.op, op.module, op.phase) == ("aten.mul.Tensor", "b", "backward")
    assert op.source is not None and op.source.endswith(
        f"{_where(Boost.backward, 'g * 1e8')} in backward"
    )


def test_backward_nonfinite_names_the_forward_line() -> None:
    """sqrt's backward divides by 2·sqrt(0): the forward line that built it is named."""
    report = scan(_net(RootOfZero()), X, trace=True)
    op = report.trace.first if report.trace else None
    assert op is not None and op.phase == "backward" and op.module == "b"
    assert op.nonfinite > 0
    assert op.source is not None and op.source.endswith(
        f"{_where(RootOfZero.forward, '.sqrt()')} in forward"
    )
    assert any(i.max_abs == 0.0 for i in op.inputs)  # the zero it divides by


def test_log_of_a_negative_traces_by_itself() -> None:
    """Not asked: a non-finite output starts the trace, and the error names the op."""
    report = scan(_net(LogNeg()), X)
    tr = report.trace
    assert tr is not None and tr.reason == "non-finite" and tr.first is not None
    assert (tr.first.op, tr.first.module) == ("aten.log.default", "b")
    assert tr.first.code == "return torch.log(x - 100.0)"
    err = [f for f in report.findings if f.severity is Severity.ERROR]
    assert err and "aten.log.default in b" in err[0].message


def test_zero_times_inf_names_the_exp_not_the_multiply() -> None:
    """exp overflows first (inf from finite inputs); the NaN of 0·inf is inherited."""
    report = scan(_net(ZeroInf()), X)
    op = report.trace.first if report.trace else None
    assert op is not None and op.op == "aten.exp.default" and op.code is not None
    assert op.code.startswith("big = torch.exp")


def test_causal_mask_infinities_are_given_not_made() -> None:
    """masked_fill(mask, -inf) writes infinities it was given: not a break."""

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
            s = (x @ x.T).masked_fill(mask[:4, :4], float("-inf"))
            return s.softmax(-1) @ x

    report = scan(_net(Masked()), X, dtype="fp16", trace=True)
    assert report.trace is not None and report.trace.first is None


def test_model_comes_back_bit_for_bit() -> None:
    model = _net(Hidden())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scan(model, X, dtype="fp16", trace=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_not_asked_and_nothing_broke_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("the trace ran")

    monkeypatch.setattr(trace_mod, "trace_batch", boom)
    report = scan(_net(nn.Identity()), X)
    assert report.trace is None and "trace" not in report.to_dict()


def test_json_round_trip_and_schema() -> None:
    report = scan(_net(Hidden()), X, dtype="fp16", trace=True)
    data = json.loads(report.to_json())
    jsonschema.validate(data, load_schema())
    assert Report.from_dict(data).trace == report.trace
    md = to_markdown(report)
    assert "#### Trace" in md and "aten.mul.Tensor" in md


def _scaled_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e4)
    return model


def test_transformers_gpt2_overflow() -> None:
    report = scan(_scaled_gpt2(), dtype="fp16", batch=2, seq_len=8)
    tr = report.trace
    assert tr is not None and tr.reason == "non-finite" and tr.first is not None
    op = tr.first
    # c_fc's output is finite (the recorder says so): x³ in gelu_new is what overflows
    assert report.layer("transformer.h.1.mlp.c_fc").nonfinite == 0
    assert (op.op, op.module, op.phase) == (
        "aten.pow.Tensor_Scalar",
        "transformer.h.1.mlp.act",
        "forward",
    )
    (inp,) = op.inputs
    assert inp.nonfinite == 0 and inp.max_abs is not None and inp.max_abs**3 > 65504
    # the line is transformers' own, found outside torch and actscan
    assert op.source is not None and "transformers/activations.py" in op.source
    assert "torch.pow(input, 3.0)" in (op.code or "")


def test_builtin_family_overflow() -> None:
    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    model = build_model(cfg)
    with torch.no_grad():
        model.blocks[1].mlp.up.weight.mul_(3e5)
    report = scan(model, dtype="fp16", batch=2, seq_len=8)
    op = report.trace.first if report.trace else None
    assert op is not None and op.module == "blocks.1.mlp.up" and op.phase == "forward"
    assert op.source is not None and op.source.startswith("actscan/models/gpt.py:")


FACTORY = """
import torch
from torch import nn


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x) * 1e5
        return torch.tanh(h)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), Inner(), nn.Linear(16, 16)), torch.randn(4, 16)
"""


def test_module_callable_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "trace_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trace_factory", raising=False)
    scanned = scan_target("trace_factory:build", Settings(trace=True, dtype="fp16", device="cpu"))
    op = scanned.report.trace.first if scanned.report.trace else None
    assert op is not None and op.module == "1" and op.op == "aten.mul.Tensor"
    assert op.source is not None and "trace_factory.py:12 in forward" in op.source


def test_compiled_model_is_traced_eagerly() -> None:
    """A compiled model: the scan (and so the trace) runs its eager original."""
    compiled = torch.compile(_net(Hidden()), backend="eager")
    report = scan(compiled, X, dtype="fp16", trace=True)
    op = report.trace.first if report.trace else None
    assert op is not None and (op.op, op.module) == ("aten.mul.Tensor", "b")


@pytest.mark.slow
def test_compiled_submodule_runs_eagerly_under_the_trace() -> None:
    model = _net(Hidden())
    model.b = torch.compile(model.b, backend="eager")  # type: ignore[assignment]
    report = scan(model, X, dtype="fp16", trace=True)
    op = report.trace.first if report.trace else None
    assert op is not None and op.op == "aten.mul.Tensor" and op.code == "h = h * 1e5"


def test_diverged_step_is_traced_at_its_weights() -> None:
    """SGD at a huge rate: step 0 is finite, a later step overflows; the trace reruns that
    step's batch at that step's weights."""
    report = scan(_net(nn.ReLU()), X, steps=4, optimizer="sgd", lr=1e3)
    d = report.dynamics
    assert d is not None
    bad = [s.t for s in d.steps if s.nonfinite]
    assert bad and bad[0] > 0
    first_module = next(n for st, n in d.steps[bad[0]].nonfinite if st == "activation")
    tr = report.trace
    assert tr is not None and tr.reason == "diverged" and (tr.step, tr.batch) == (bad[0],) * 2
    op = tr.first
    assert op is not None and op.module == first_module and op.phase == "forward"
    # finite inputs at W_t whose product leaves fp32: the weights the steps blew up
    assert op.inputs and all(i.nonfinite == 0 for i in op.inputs)
    assert math.prod(sorted(i.max_abs or 0.0 for i in op.inputs)[-2:]) > 3.4e38
    err = [f for f in report.findings if f.message.startswith("Training diverged")]
    assert err and f"{op.op} in {op.module}" in err[0].message


class Hot(nn.Module):
    """Under fp16 autocast exp runs in fp32: e^12 ≈ 1.6e5 is finite there, and overflows
    only when the next fp16 matmul casts it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.float() * 0 + 12.0)


def test_autocast_fp32_output_beyond_fp16_is_named_before_the_cast() -> None:
    report = scan(_net(Hot()), X, amp="fp16")
    tr = report.trace
    assert tr is not None and tr.dtype == "fp16" and tr.ceiling == 65504.0
    op = tr.first
    assert op is not None and (op.op, op.module) == ("aten.exp.default", "b")
    assert op.nonfinite == 0 and op.max_abs == pytest.approx(math.exp(12.0), rel=1e-6)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(1e5)
        return torch.tanh(h)


def test_in_place_overflow_is_named() -> None:
    """An in-place op returns the tensor it was given: its output is reduced again."""
    report = scan(_net(InPlace()), X, dtype="fp16", trace=True)
    op = report.trace.first if report.trace else None
    assert op is not None and (op.op, op.module, op.code) == (
        "aten.mul_.Tensor",
        "b",
        "h.mul_(1e5)",
    )


def test_a_trace_a_sharded_rank_cannot_run_is_said_not_skipped_silently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from actscan.measure import trace as tr

    sharded = SimpleNamespace(ranks=SimpleNamespace(sharded=True))
    note = tr.untraced_note(sharded, asked=True)  # type: ignore[arg-type]
    assert note is not None and "asked (--trace)" in note and "without --nproc" in note
    monkeypatch.setattr(tr, "broke", lambda _p: "non-finite")
    note = tr.untraced_note(sharded, asked=False)  # type: ignore[arg-type]
    assert note is not None and "the pass broke (non-finite)" in note
    monkeypatch.setattr(tr, "broke", lambda _p: None)
    assert tr.untraced_note(sharded, asked=False) is None  # type: ignore[arg-type]
    one = SimpleNamespace(ranks=SimpleNamespace(sharded=False))
    assert tr.untraced_note(one, asked=True) is None  # type: ignore[arg-type]
