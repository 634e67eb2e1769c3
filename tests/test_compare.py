"""`actscan compare`: matching, ratios, finding diffs, the precision-divergence pass
(against an independent recomputation), the JSON document, the plot and exit codes.

Models are tiny (d = 64, ≤ 24 blocks, 2 × 16 tokens). Findings are planted by handing the
CLI another check runner (`Wiring(checks=...)`), so the A-only/B-only/both logic and the
gate are tested independently of which real checks exist.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import planted_checks
from typer.testing import CliRunner

from actscan.api import Wiring
from actscan.cli import app
from actscan.compare.pairs import compare_reports, diff_findings, match_layers
from actscan.compare.precision import Precision, default_inputs, precision_divergence
from actscan.errors import ActscanError
from actscan.records import Finding, Severity
from actscan.report.report import Report
from actscan.run import scan
from actscan.targets.resolve import resolve
from actscan.targets.resolved import TargetOptions

SMALL = {"d_model": "64", "vocab_size": "128"}
RUN = ["--seq-len", "16", "--batch", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def measure(target: str, init: str | None = None, **overrides: str) -> Report:
    r = resolve(target, TargetOptions(init=init, overrides={**SMALL, **overrides}))
    return scan(r.model, info=r.info, batch=2, seq_len=16, seed=0, init=init)


def cli(*args: str, obj: Wiring | None = None) -> Any:
    return CliRunner().invoke(app, list(args), obj=obj)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No project config from the repository; plain output."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ACTSCAN_DEBUG", raising=False)
    return tmp_path


def planted(rule: Any) -> Wiring:
    """The CLI wired to report rule(ctx) instead of the real checks."""
    return Wiring(checks=planted_checks(lambda ctx: tuple(rule(ctx))))


def finding(check: str, severity: str = "warn", layers: tuple[str, ...] = ()) -> Finding:
    return Finding(check, Severity(severity), layers, 1.0, 0.5, f"{check} planted")


# -- matching and ratios ---------------------------------------------------------------------
def test_a_config_compared_with_itself_gives_ratios_of_exactly_one() -> None:
    a = measure("gpt-12-preln", n_layers="4")
    b = measure("gpt-12-preln", n_layers="4")
    cmp = compare_reports(a, b)
    assert len(cmp.stream) == 5 and len(cmp.branches) == 8
    assert all(p.ratio == 1.0 and p.grad_ratio == 1.0 for p in cmp.stream)
    assert all(p.rms_ratio == 1.0 for p in cmp.branches)
    assert len(cmp.layers) == len(a.layers) and all(p.matched_by == "name" for p in cmp.layers)
    assert all(p.ratio == 1.0 for p in cmp.layers if p.rms_a is not None)
    assert not cmp.unmatched_a and not cmp.unmatched_b
    assert not cmp.findings.a_only and not cmp.findings.b_only
    assert len(cmp.findings.both) == len(a.findings)
    assert cmp.verdict.startswith("A and B measure the same")


@pytest.mark.slow
def test_naive_init_grows_and_fan_in_with_depth_scaling_stays_flat() -> None:
    """gpt2 0.02 without branch scaling vs fan-in + 1/√(2L) on the 48-layer config's family."""
    a = measure("gpt-48-naive", n_layers="24")
    b = measure("gpt-48-naive", init="fan-in", n_layers="24", branch_scale="depth")
    cmp = compare_reports(a, b)
    rms_a = [p.rms_a for p in cmp.stream]
    rms_b = [p.rms_b for p in cmp.stream]
    assert rms_a[-1] / rms_a[0] > 3  # √k-like growth
    assert rms_b[-1] / rms_b[0] < 1.3  # flat
    # B ÷ A falls through depth: the ratio at the end is a fraction of the one at k = 0.
    ratios = [p.ratio for p in cmp.stream]
    assert ratios[-1] < 0.4 * ratios[0]
    assert sum(r2 < r1 for r1, r2 in itertools.pairwise(ratios)) >= 0.9 * (len(ratios) - 1)
    assert cmp.a.summary["growth_exponent"] > 0.3 > 0.1 > cmp.b.summary["growth_exponent"]
    assert "B keeps the stream flatter" in cmp.verdict


def test_layers_match_by_structure_when_names_differ_and_leftovers_are_listed() -> None:
    a = measure("gpt-12-preln", n_layers="3")
    b = measure("gpt-12-preln", n_layers="4")
    # B with foreign names, as another family would have them.
    renamed = tuple(
        replace(
            r, name=r.name.replace("blocks.", "transformer.h.").replace("mlp.down", "mlp.c_proj")
        )
        for r in b.layers
    )
    b = replace(b, layers=renamed)
    pairs, un_a, un_b = match_layers(a.layers, b.layers)
    by_a = {p.name_a: p for p in pairs}
    assert by_a["blocks.2.mlp.down"].name_b == "transformer.h.2.mlp.c_proj"
    assert by_a["blocks.2.mlp.down"].matched_by == "structure"
    assert by_a["blocks.0.attn.qkv"].name_b == "transformer.h.0.attn.qkv"
    assert by_a["tok_emb"].matched_by == "name"
    assert not un_a
    assert un_b and all(n.startswith("transformer.h.3") for n in un_b)
    # Depth differs: the stream pairs by k, B's last block has no partner in A.
    cmp = compare_reports(a, b)
    assert [p.k for p in cmp.stream] == [0, 2, 4, 6, 8]
    assert cmp.stream[-1].rms_a is None and cmp.stream[-1].rms_b is not None
    assert cmp.stream[-1].ratio is None
    assert cmp.unmatched_b == un_b and cmp.notes


def test_findings_split_into_a_only_b_only_and_both() -> None:
    fa = [
        finding("sqrt-growth", "warn", ("blocks.3",)),
        finding("dead-units", "info", ("blocks.0.mlp.act",)),
    ]
    fb = [
        finding("sqrt-growth", "error", ("h.3",)),
        finding("overflow", "error", ("h.1.attn.logits",)),
    ]
    diff = diff_findings(fa, fb, {"blocks.3": "h.3"})
    assert [f.check for f in diff.a_only] == ["dead-units"]
    assert [f.check for f in diff.b_only] == ["overflow"]
    assert [(x.severity, y.severity) for x, y in diff.both] == [(Severity.WARN, Severity.ERROR)]


def test_findings_pair_by_mapped_layers_first() -> None:
    fa = [
        finding("outlier-channels", layers=("a.1",)),
        finding("outlier-channels", layers=("a.2",)),
    ]
    fb = [finding("outlier-channels", layers=("b.2",))]
    diff = diff_findings(fa, fb, {"a.1": "b.1", "a.2": "b.2"})
    assert diff.both[0][0].layers == ("a.2",)
    assert [f.layers for f in diff.a_only] == [("a.1",)]


# -- precision divergence ----------------------------------------------------------------------
def _direct_rel_err(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> float:
    """Independent: the logits of the model and of a cast copy, compared directly."""
    with torch.no_grad():
        hi = model.eval()(ids).double()
        lo = copy.deepcopy(model).to(dtype).eval()(ids).double()
    return float((hi - lo).norm() / hi.norm())


@pytest.fixture(scope="module")
def twelve() -> Any:
    return resolve("gpt-12-preln", TargetOptions(overrides=SMALL))


def test_bf16_divergence_is_small_nonzero_and_grows_with_depth(twelve: Any) -> None:
    model = twelve.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = precision_divergence(
        model,
        default_inputs(twelve.info, 2, 16, 0),
        high=Precision("fp32"),
        low=Precision("bf16"),
        reference_side="a",
        threshold=0.05,
        model_type=twelve.info.family,
    )
    # The caller's model is neither cast nor changed.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    blocks = [d.layer(f"blocks.{i}") for i in range(12)]
    assert all(0 < x.rel_err < 0.05 and 0.999 < x.cosine < 1 for x in blocks)
    early = sum(x.rel_err for x in blocks[:3]) / 3
    late = sum(x.rel_err for x in blocks[-3:]) / 3
    assert late > 1.5 * early
    assert d.first is None and d.reference == "fp32" and d.other == "bf16"
    # Execution order: the stream input first, the head last.
    assert d.layers[0].name == "blocks.0:input" and d.layers[-1].name == "head"
    ids = default_inputs(twelve.info, 2, 16, 0)(0).args[0]
    assert d.layer("head").rel_err == pytest.approx(
        _direct_rel_err(model, ids, torch.bfloat16), rel=1e-3
    )


def test_same_precision_has_zero_divergence_and_threshold_marks_the_first_layer(
    twelve: Any,
) -> None:
    src = default_inputs(twelve.info, 2, 16, 0)
    same = precision_divergence(
        twelve.model, src, high=Precision(), low=Precision(), reference_side="a", threshold=0.05
    )
    assert all(x.rel_err == 0.0 for x in same.layers) and same.first is None
    strict = precision_divergence(
        twelve.model,
        src,
        high=Precision(),
        low=Precision("bf16"),
        reference_side="a",
        threshold=0.005,
        scope="all",
    )
    first = strict.layer(strict.first)  # type: ignore[arg-type]
    assert first.rel_err > 0.005
    assert all(x.rel_err <= 0.005 for x in strict.layers if x.order < first.order)
    assert len(strict.layers) > len(same.layers)  # --all: every module


def test_amp_side_is_the_lower_precision() -> None:
    assert Precision("fp32", "bf16").bits < Precision("fp16").bits < Precision("fp32").bits
    assert Precision("fp32", "bf16").label == "fp32 amp bf16"


# -- the command ------------------------------------------------------------------------------
COMPARE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "kind",
        "tool",
        "labels",
        "match",
        "stream",
        "branches",
        "layers",
        "unmatched",
        "summary",
        "findings",
        "divergence",
        "verdict",
        "a",
        "b",
    ],
    "properties": {
        "schema_version": {"const": 1},
        "kind": {"const": "compare"},
        "labels": {"type": "object", "required": ["a", "b"]},
        "match": {"enum": ["name", "name+structure"]},
        "stream": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "k",
                    "block",
                    "name_a",
                    "name_b",
                    "rms_a",
                    "rms_b",
                    "ratio",
                    "grad_rms_a",
                    "grad_rms_b",
                    "grad_ratio",
                ],
            },
        },
        "branches": {
            "type": "array",
            "items": {"required": ["block", "kind", "ratio_a", "ratio_b", "rms_ratio"]},
        },
        "layers": {
            "type": "array",
            "items": {"required": ["name_a", "name_b", "role", "block", "matched_by", "ratio"]},
        },
        "unmatched": {"type": "object", "required": ["a", "b"]},
        "summary": {"type": "object", "required": ["a", "b"]},
        "findings": {"type": "object", "required": ["a_only", "b_only", "both"]},
        "divergence": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": [
                        "reference",
                        "other",
                        "reference_side",
                        "threshold",
                        "scope",
                        "first",
                        "layers",
                    ],
                    "properties": {
                        "layers": {
                            "type": "array",
                            "items": {
                                "required": [
                                    "name",
                                    "role",
                                    "block",
                                    "order",
                                    "rel_err",
                                    "cosine",
                                    "rms",
                                ]
                            },
                        }
                    },
                },
            ]
        },
        "verdict": {"type": "string"},
    },
}


@pytest.mark.slow
def test_cli_dtype_compare_json_has_the_documented_shape(isolated: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from actscan.report.schema import validate_report

    out = isolated / "cmp.json"
    res = cli(
        "compare",
        "gpt-12-preln",
        "--set",
        "n_layers=4",
        "--set",
        "d_model=64",
        "--dtype",
        "fp32",
        "--vs-dtype",
        "bf16",
        "--json",
        str(out),
        "--quiet",
        *RUN,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    jsonschema.validate(data, COMPARE_SCHEMA)
    validate_report(data["a"])
    validate_report(data["b"])
    assert data["a"]["run"]["dtype"] == "fp32" and data["b"]["run"]["dtype"] == "bf16"
    div = data["divergence"]
    assert div["reference"] == "fp32" and div["other"] == "bf16" and div["first"] is None
    assert div["threshold"] == 0.05
    assert all(0 < x["rel_err"] < 0.05 for x in div["layers"])
    assert "run it in the precision you will actually train in" in data["verdict"]
    # Same weights, same inputs: the stream at k = 0 is the same embedding up to bf16.
    assert math.isclose(data["stream"][0]["ratio"], 1.0, rel_tol=0.01)


@pytest.mark.slow
def test_cli_init_compare_table_and_a_threshold_override(isolated: Path) -> None:
    res = cli(
        "compare",
        "gpt-48-naive",
        "--set",
        "n_layers=8",
        "--set",
        "d_model=64",
        "--vs-init",
        "fan-in",
        "--vs-set",
        "branch_scale=depth",
        *RUN,
    )
    assert res.exit_code == 0, res.output
    out = res.stdout
    for text in (
        "Residual stream (ratio = B ÷ A)",
        "Branches",
        "Growth fit",
        "γ (gain per block)",
        "A: gpt-48-naive --set n_layers=8 --set d_model=64",
        "B: A --init fan-in --set branch_scale=depth",
        "Verdict: B keeps",
    ):
        assert text in out
    assert "Divergence" not in out  # different weights: no divergence pass
    strict = cli(
        "compare",
        "gpt-12-preln",
        "--set",
        "n_layers=4",
        "--set",
        "d_model=64",
        "--vs-dtype",
        "bf16",
        "--threshold",
        "divergence-rel-err=0.001",
        "--quiet",
        *RUN,
    )
    assert strict.exit_code == 0, strict.output
    assert "bf16 departs from fp32 by more than 0.1%" in strict.stdout


@pytest.mark.slow
def test_cli_gate_covers_both_sides(isolated: Path) -> None:
    """A warn only where branch_scale is 'depth' (side B) → B only; --fail-on decides."""
    wired = planted(
        lambda ctx: (
            (
                [finding("init-scale", "warn", ("blocks.0.attn.proj",))]
                if ctx.info.arch.get("branch_scale") == "depth"
                else []
            )
            + [finding("sqrt-growth", "info", ("blocks.1",))]
        ),
    )
    base = [
        "compare",
        "gpt-12-preln",
        "--set",
        "n_layers=2",
        "--set",
        "d_model=64",
        "--set",
        "branch_scale=none",
        "--vs-set",
        "branch_scale=depth",
        *RUN,
    ]
    warn = cli(*base, "--fail-on", "warn", "--json", "-", obj=wired)
    assert warn.exit_code == 1, warn.output
    data = json.loads(warn.stdout)
    assert [f["check"] for f in data["findings"]["b_only"]] == ["init-scale"]
    assert data["findings"]["a_only"] == []
    assert [x["a"]["check"] for x in data["findings"]["both"]] == ["sqrt-growth"]
    assert cli(*base, "--fail-on", "error", obj=wired).exit_code == 0
    # The gate counts side A too: the info finding is on both sides.
    both = cli(*base, "--fail-on", "info", "--vs-set", "branch_scale=none", obj=wired)
    assert both.exit_code == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gpt-12-preln"], "nothing to compare"),
        (["no-such-model", "--vs-init", "fan-in"], "no such file or folder"),
        (["gpt-12-preln", "--vs-dtype", "bf16", "--vs-amp", "bf16"], "autocast"),
        # B's mistakes name the option typed for B, A's the plain one
        (["gpt-12-preln", "--vs-init", "bogus"], "--vs-init must be one of"),
        (["gpt-12-preln", "--vs-set", "n_layers"], "--vs-set expects key=value"),
        (["gpt-12-preln", "--vs-set", "bogus_key=1"], "--vs-set: unknown key 'bogus_key'"),
        (["gpt-12-preln", "--set", "bogus_key=1", "--vs-init", "fan-in"], "--set: unknown key"),
    ],
)
def test_cli_usage_errors_exit_2(isolated: Path, args: list[str], needle: str) -> None:
    res = cli("compare", *args, "--set", "n_layers=2", "--set", "d_model=32", *RUN)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.output


@pytest.mark.slow
def test_plot_is_a_png(isolated: Path) -> None:
    pytest.importorskip("matplotlib")
    out = isolated / "cmp.png"
    res = cli(
        "compare",
        "gpt-12-preln",
        "--set",
        "n_layers=2",
        "--set",
        "d_model=32",
        "--vs-init",
        "fan-in",
        "--plot",
        str(out),
        "--quiet",
        *RUN,
    )
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_says_how_to_install(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actscan.render.plot import Series, plot_streams

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ActscanError, match=r"actscan\[plot\]"):
        plot_streams([Series("x", (0, 1), (1.0, 2.0))], isolated / "x.png")
    assert not (isolated / "x.png").exists()
