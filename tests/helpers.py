"""Builders the tests share: hand-built records (check contexts, Reports), the golden-file
comparison and the one-line CLI error assertion. Tests import them with
`from helpers import ...`; conftest.py keeps only fixtures and hooks."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from actscan.diagnose import CheckContext
from actscan.diagnose.thresholds import DEFAULT, Thresholds
from actscan.records import (
    BlockInfo,
    BranchRecord,
    Finding,
    LayerRecord,
    Layout,
    ModelInfo,
    ParamRecord,
    RunInfo,
    Severity,
    Skip,
    StreamPoint,
    Summary,
    growth_fit,
)
from actscan.report.report import Report
from actscan.run import CheckRunner

# --------------------------------------------------------------------------- golden files
GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_ENV = "ACTSCAN_UPDATE_GOLDENS"
UPDATE_FLAG = "--update-goldens"


def check_golden(name: str, text: str, *, update: bool, folder: Path = GOLDEN_DIR) -> None:
    """Compare `text` with the golden file `folder/name`.

    A missing golden file is a failure, never a fresh golden: goldens are written only when
    `update` is set (pytest --update-goldens, or ACTSCAN_UPDATE_GOLDENS=1).
    """
    path = folder / name
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    if not path.is_file():
        pytest.fail(
            f"golden file {path} is missing: create it with pytest {UPDATE_FLAG} "
            f"(or {UPDATE_ENV}=1) and review it",
            pytrace=False,
        )
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"golden/{name}",
                "now",
            )
        )
        pytest.fail(
            f"output differs from golden/{name} (if intended: pytest {UPDATE_FLAG}):\n{diff}",
            pytrace=False,
        )


# --------------------------------------------------------------------------- check contexts
def layout(n_blocks: int) -> Layout:
    blocks = tuple(
        BlockInfo(i, f"blocks.{i}", attn=f"blocks.{i}.attn", mlp=f"blocks.{i}.mlp")
        for i in range(n_blocks)
    )
    block_of = {f"blocks.{i}": i for i in range(n_blocks)}
    return Layout(blocks=blocks, head="head", block_of=block_of)


def stream(rms: Sequence[float], grad: Sequence[float] | None = None) -> tuple[StreamPoint, ...]:
    """rms[0] is the first block's input (k = 0), rms[i] block i-1's output (k = 2i)."""
    pts = []
    for i, r in enumerate(rms):
        g = grad[i] if grad is not None else None
        name = "blocks.0:input" if i == 0 else f"blocks.{i - 1}"
        block = None if i == 0 else i - 1
        pts.append(StreamPoint(k=2 * i, block=block, name=name, rms=r, grad_rms=g, max_abs=4 * r))
    return tuple(pts)


def rec(name: str, **kw: object) -> LayerRecord:
    block = kw.pop("block", None)
    if block is None and (m := re.match(r"blocks\.(\d+)", name)):
        block = int(m.group(1))
    base: dict[str, Any] = dict(
        name=name,
        type="Linear",
        role="other",
        block=block,
        calls=1,
        mean=0.0,
        std=1.0,
        rms=1.0,
        max_abs=3.0,
        zero_frac=0.0,
        numel=1000,
        order=0,
    )
    base.update(kw)
    return LayerRecord(**base)


def param(
    name: str,
    std: float,
    *,
    fan_in: int | None = None,
    kind: str = "weight",
    mean: float = 0.0,
    fan_out: int | None = None,
    nonfinite: int = 0,
) -> ParamRecord:
    module = name.rsplit(".", 1)[0]
    m = re.match(r"blocks\.(\d+)", name)
    shape = (fan_out or fan_in or 1, fan_in or 1) if kind == "weight" else (fan_out or 1,)
    return ParamRecord(
        name=name,
        module=module,
        role="other",
        block=int(m.group(1)) if m else None,
        shape=shape,
        mean=mean,
        std=std,
        fan_in=fan_in,
        fan_out=fan_out or fan_in,
        kind=kind,
        nonfinite=nonfinite,
    )


def ctx(
    *,
    points: tuple[StreamPoint, ...] = (),
    layers: Sequence[LayerRecord] = (),
    params: Sequence[ParamRecord] = (),
    n_blocks: int | None = None,
    at_init: bool = False,
    arch: dict[str, object] | None = None,
    vocab: int | None = 512,
    dtype: str = "fp32",
    amp: str | None = None,
    backward: bool = True,
    seq_len: int = 64,
    th: Thresholds = DEFAULT,
) -> CheckContext:
    nb = n_blocks if n_blocks is not None else max(len(points) - 1, 0)
    info = ModelInfo(
        source="synthetic",
        family="custom",
        n_params=0,
        n_blocks=nb,
        vocab_size=vocab,
        at_init=at_init,
        arch=arch or {},
    )
    run = RunInfo(dtype=dtype, amp=amp, backward=backward, batch=4, seq_len=seq_len)
    return CheckContext(
        info=info,
        run=run,
        layout=layout(nb),
        layers=tuple(layers),
        stream=points,
        fit=growth_fit(points),
        params=tuple(params),
        thresholds=th,
    )


def only(findings: Sequence[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.check == check]


def accumulator(n_blocks: int, a: float, v: float, scale: float = 1.0) -> list[float]:
    """Var(x_k) = a + v·k·scale: the residual accumulator model, k = 2 per block."""
    return [math.sqrt(a + v * scale * 2 * i) for i in range(n_blocks + 1)]


def geometric(n_blocks: int, gamma: float, start: float = 1.0) -> list[float]:
    return [start] + [start * gamma**i for i in range(n_blocks)]


def branch_layers(n_blocks: int, *, stream_rms: float = 1.0, **override: dict) -> list[LayerRecord]:
    """attn/mlp branch outputs at 0.3 of the stream; `override[name]` replaces fields."""
    out, order = [], 0
    for i in range(n_blocks):
        for kind in ("attn", "mlp"):
            name = f"blocks.{i}.{kind}"
            fields = dict(
                role=kind, rms=0.3 * stream_rms, grad_rms=1.0, param_grad_norm=1.0, order=order
            )
            fields.update(override.get(name, {}))
            out.append(rec(name, **fields))
            order += 2
    return out


def flat_stream(n_blocks: int, grad: float = 1.0) -> tuple[StreamPoint, ...]:
    return stream([1.0] * (n_blocks + 1), [grad] * (n_blocks + 1))


def with_gains(n_blocks: int, value: float, gain_rms: float) -> tuple[list, list]:
    layers, params = branch_layers(n_blocks), []
    for r in list(layers):
        gain = r.name.replace(".attn", ".attn_gain").replace(".mlp", ".mlp_gain")
        layers.append(rec(gain, rms=gain_rms, max_abs=gain_rms, order=r.order + 1))
        params.append(param(f"{gain}.gain", 0.0, kind="other", mean=value, fan_out=16))
    return layers, params


def act(name: str, dead: int, width: int = 1024, rows: int = 256, **kw: object) -> LayerRecord:
    """An activation layer with `dead` of `width` channels zero on all `rows` rows."""
    return rec(
        name,
        role="act",
        type="ReLU",
        n_channels=width,
        dead_channels=dead,
        numel=width * rows,
        **kw,
    )


def outlier_rec(name: str, ratio: float, channels: tuple[int, ...] = (17,), **kw) -> LayerRecord:
    median = 3.0
    return rec(
        name,
        channel_max_ratio=ratio,
        outlier_channels=channels,
        channel_median_max=median,
        max_abs=ratio * median,
        n_channels=64,
        **kw,
    )


def head(std: float, max_abs: float | None = None) -> LayerRecord:
    """The output head: it runs last (logit-scale judges only the model's output)."""
    return rec(
        "head",
        role="head",
        std=std,
        mean=0.0,
        max_abs=max_abs or 5 * std,
        n_channels=512,
        order=10**6,
    )


def projections(n_blocks: int, out_scale: float) -> tuple[list[LayerRecord], list[ParamRecord]]:
    layers, params = [], []
    for i in range(n_blocks):
        for j, (mod, fan) in enumerate(
            (("attn.qkv", 64), ("attn.proj", 64), ("mlp.up", 64), ("mlp.down", 256))
        ):
            name = f"blocks.{i}.{mod}"
            layers.append(rec(name, order=10 * i + j))
            std = 0.02 * (out_scale if mod in ("attn.proj", "mlp.down") else 1.0)
            params.append(param(f"{name}.weight", std, fan_in=fan))
    return layers, params


# --------------------------------------------------------------------------- reports
def make_report(
    source: str = "configs/tiny-gpt.json", *, nonfinite: bool = False, findings: bool = True
) -> Report:
    """A hand-built two-block Report: every table row, branch and finding is written out
    here, so rendered goldens do not move with torch. Covers None, 0, a value ≥ 1e5 and
    (with `nonfinite`) nan/inf."""
    nan, inf = float("nan"), float("inf")
    layers = (
        LayerRecord(
            name="wte",
            type="Embedding",
            role="embed",
            block=None,
            calls=1,
            mean=0.001,
            std=0.0201,
            rms=0.0201,
            max_abs=0.0912,
            zero_frac=0.0,
            channel_max_ratio=1.8,
            grad_rms=1.2e-5,
            grad_norm=0.0031,
            param_grad_norm=0.0031,
            numel=8192,
            n_channels=64,
            dead_channels=0,
            channel_median_max=0.05,
            order=0,
        ),
        LayerRecord(
            name="h.0.attn",
            type="Attention",
            role="attn",
            block=0,
            calls=1,
            mean=0.0,
            std=0.3,
            rms=0.3,
            max_abs=1.5,
            zero_frac=None,
            channel_max_ratio=2.5,
            grad_rms=0.0004,
            grad_norm=0.05,
            param_grad_norm=0.12,
            order=1,
        ),
        LayerRecord(
            name="h.0.mlp",
            type="MLP",
            role="mlp",
            block=0,
            calls=1,
            mean=nan if nonfinite else -0.002,
            std=inf if nonfinite else 0.51,
            rms=inf if nonfinite else 0.51,
            max_abs=inf if nonfinite else 12.5,
            zero_frac=0.0,
            nonfinite=3 if nonfinite else 0,
            channel_max_ratio=24.0,
            outlier_channels=(17, 40),
            grad_rms=None,
            grad_norm=None,
            param_grad_norm=None,
            order=2,
        ),
        LayerRecord(
            name="h.0.mlp.act",
            type="ReLU",
            role="act",
            block=0,
            calls=1,
            mean=0.2,
            std=0.31,
            rms=0.37,
            max_abs=9.0,
            zero_frac=0.5,
            channel_max_ratio=3.0,
            grad_rms=0.0002,
            order=3,
        ),
    )
    stream = (
        StreamPoint(k=0, block=None, name="drop", rms=0.0201, grad_rms=1.2e-5),
        StreamPoint(k=2, block=0, name="h.0", rms=1.234, grad_rms=0.0123, max_abs=6.0),
        StreamPoint(
            k=4,
            block=1,
            name="h.1",
            rms=inf if nonfinite else 123456.0,
            grad_rms=None,
            mean=0.0,
            std=1.0,
            max_abs=3.0,
        ),
    )
    branches = (
        BranchRecord(
            block=0,
            kind="attn",
            name="h.0.attn",
            rms=0.3,
            stream_rms=0.0201,
            ratio=14.9,
            max_abs=1.5,
            channel_max_ratio=2.5,
            grad_rms=0.0004,
            param_grad_norm=0.12,
        ),
        BranchRecord(
            block=0,
            kind="mlp",
            name="h.0.mlp",
            rms=0.51,
            stream_rms=0.0201,
            ratio=25.4,
            max_abs=12.5,
            channel_max_ratio=24.0,
            grad_rms=None,
            param_grad_norm=None,
        ),
    )
    found = (
        Finding(
            check="outlier-channels",
            severity=Severity.WARN,
            layers=("h.0.mlp",),
            value=24.0,
            threshold=6.0,
            message="2 channels dwarf the median | max/median 24",
            hint="per-tensor int8 would lose them",
        ),
        Finding(
            check="sqrt-growth",
            severity=Severity.INFO,
            layers=(),
            value=0.52,
            threshold=None,
            message="stream RMS grows like k^0.52",
        ),
        Finding(
            check="exp-growth",
            severity=Severity.ERROR,
            layers=("h.0", "h.1", "h.2", "h.3", "h.4"),
            value=1e5,
            threshold=100.0,
            message="stream RMS grows 1e5x over 2 blocks",
            hint="scale residual projections by 1/sqrt(2L)",
        ),
        Finding(
            check="outlier-channels",
            severity=Severity.INFO,
            layers=("h.1.mlp",),
            value=7.0,
            threshold=6.0,
            message="1 channel above 6",
        ),
    )
    return Report(
        model=ModelInfo(
            source=source,
            family="actscan-gpt",
            n_params=124_439_808,
            n_blocks=2,
            d_model=64,
            vocab_size=128,
            at_init=True,
            task="causal-lm",
            arch={"norm": "pre"},
        ),
        run=RunInfo(dtype="bf16", batch=2, seq_len=64, seed=0),
        layers=layers,
        stream=stream,
        findings=found if findings else (),
        summary=Summary(
            growth_exponent=0.52,
            gain_per_block=1.07,
            growth=120000.0,
            var_intercept=None,
            var_slope=0.0005,
            grad_ratio=nan if nonfinite else 3.2,
        ),
        notes=("blocks: h (2 × Block)",),
        branches=branches,
    )


# --------------------------------------------------------------------------- CLI results
def one_line_error(result: Any, *needles: str) -> str:
    """A CLI result that exits 2 with exactly one `actscan: error:` line on stderr holding
    every needle, and no traceback; returns the line."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actscan: error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def planted_checks(checks: Callable[..., Iterable[Finding]]) -> CheckRunner:
    """A check runner reporting `checks(ctx)` (no skips) instead of the real checks: pass it
    to `scan_target(checks=...)`, `scan_model(checks=...)` or, for the CLI, as
    `CliRunner().invoke(app, args, obj=Wiring(checks=...))`."""

    def run(ctx: CheckContext) -> tuple[tuple[Finding, ...], tuple[Skip, ...]]:
        return tuple(checks(ctx)), ()

    return run


# The real standard-parametrization width sweep the coordinate-check tests share: three
# widths, two steps at lr 1e-2, small enough for the suite (the coord check warns on it).
SP_WIDTH_SWEEP = (
    *("sweep", "gpt-12-preln", "--width", "32,64,128", "--steps", "2", "--lr", "1e-2"),
    *("--set", "n_layers=2", "--set", "vocab_size=128", "--set", "seq_len=16"),
    *("--set", "mup_base_width=32", "--batch", "2", "--seq-len", "16"),
)
