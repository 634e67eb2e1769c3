"""`actscan sweep`: size overrides (built-in and Hugging Face keys), the depth property
(naive grows with depth, 1/√(2L) does not), the JSON document, the plot and exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import planted_checks
from typer.testing import CliRunner

from actscan.api import Wiring
from actscan.cli import app
from actscan.compare.sweep import (
    BaseConfig,
    base_config,
    parse_lrs,
    parse_sizes,
    plan,
    size_overrides,
)
from actscan.errors import BadInputError, UsageError
from actscan.records import Finding, Severity

RUN = ["--seq-len", "16", "--batch", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ACTSCAN_DEBUG", raising=False)
    return tmp_path


def cli(*args: str, obj: Wiring | None = None) -> Any:
    return CliRunner().invoke(app, list(args), obj=obj)


# -- planning -------------------------------------------------------------------------------
def test_parse_sizes() -> None:
    assert parse_sizes("6, 12,24", "--depth") == (6, 12, 24)
    assert parse_sizes(None, "--depth") == ()
    for bad in ("6,x", "0,4", "4,4", ","):
        with pytest.raises(UsageError, match="--depth"):
            parse_sizes(bad, "--depth")


def test_builtin_width_keeps_heads_dividing_and_scales_an_explicit_mlp_width() -> None:
    base = base_config("gpt-12-preln", {"n_heads": "8", "d_ff": "512"})
    assert (base.kind, base.depth_key, base.width_key) == ("builtin", "n_layers", "d_model")
    assert size_overrides(base, 24, None) == {"n_layers": "24"}
    assert size_overrides(base, None, 512) == {"d_model": "512", "d_ff": "1024"}
    assert size_overrides(base, None, 100) == {"d_model": "100", "n_heads": "4", "d_ff": "200"}
    # Without an explicit d_ff the default 4·d follows the width by itself.
    assert size_overrides(base_config("gpt-12-preln", {}), 6, 128) == {
        "n_layers": "6",
        "d_model": "128",
    }


def test_hf_keys_gpt2_and_llama_styles() -> None:
    gpt2 = BaseConfig(
        "hf",
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None},
        "n_layer",
        "n_embd",
        "n_head",
        "n_inner",
    )
    assert size_overrides(gpt2, 6, 256) == {"n_layer": "6", "n_embd": "256", "n_head": "4"}
    llama = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "head_dim": 32,
    }
    base = BaseConfig(
        "hf", llama, "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"
    )
    assert size_overrides(base, None, 512) == {
        "hidden_size": "512",
        "intermediate_size": "1376",
        "num_key_value_heads": "2",
        "head_dim": "64",
    }
    assert size_overrides(base, None, 12)["num_attention_heads"] == "4"
    assert size_overrides(base, None, 12)["head_dim"] == "3"
    no_width = BaseConfig("hf", {"n_layer": 2}, "n_layer", None, None, None)
    with pytest.raises(UsageError, match="no width key"):
        size_overrides(no_width, None, 64)


def test_hf_config_file_is_read_without_building(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    base = base_config(str(cfg), {"n_head": "2"})
    assert (base.kind, base.depth_key, base.width_key, base.heads_key) == (
        "hf",
        "n_layer",
        "n_embd",
        "n_head",
    )
    assert base.values["n_head"] == "2"
    with pytest.raises(UsageError, match=r"config\.json"):
        base_config(str(tmp_path), {})
    with pytest.raises(BadInputError, match="no such file"):
        base_config("nope.yaml", {})


def test_plan_is_side_major_and_grids_both_axes() -> None:
    base = base_config("gpt-12-preln", {})
    pts = plan([("a", base, {}), ("b", base, {"branch_scale": "none"})], (2, 4), (32, 64))
    assert [(p.side, p.depth, p.width) for p in pts[:4]] == [
        ("a", 2, 32),
        ("a", 2, 64),
        ("a", 4, 32),
        ("a", 4, 64),
    ]
    assert dict(pts[4].overrides) == {"branch_scale": "none", "n_layers": "2", "d_model": "32"}
    with pytest.raises(UsageError, match="--depth, --width and/or --lrs"):
        plan([("a", base, {})], (), ())


def test_lrs_parse_sorted_and_plan_one_point_per_lr() -> None:
    assert parse_lrs("1e-2,1e-4, 1e-3") == (1e-4, 1e-3, 1e-2)
    for bad in ("1e-3,x", "0,1e-3", "1e-3,1e-3", "nan"):
        with pytest.raises(UsageError, match="--lrs"):
            parse_lrs(bad)
    base = base_config("gpt-12-preln", {})
    pts = plan([("a", base, {})], (2,), (), (1e-3, 1e-2))
    assert [(p.depth, p.lr) for p in pts] == [(2, 1e-3), (2, 1e-2)]
    assert pts[1].size == "depth 2 · lr 0.01"


def test_lr_sweep_reports_the_highest_lr_below_the_first_flagged_one(isolated: Path) -> None:
    """A planted step finding at lr ≥ 1e-2: the bracket's safe lr is 3e-3, the first
    flagged 1e-2, with the evidence per lr; a flag at a lower lr (3e-4) caps the bracket
    there even when a higher lr (1e-3) is quiet."""

    def checks(ctx: Any) -> tuple[Finding, ...]:
        lr = ctx.dynamics.optimizer.lr if ctx.dynamics is not None else 0.0
        if lr >= 1e-2 or lr == pytest.approx(3e-4):
            return (Finding("update-size", Severity.WARN, ("x",), 0.5, 0.2, "planted"),)
        return ()

    wired = Wiring(checks=planted_checks(checks))
    args = ["sweep", "gpt-12-preln", "--set", "n_layers=2", "--set", "d_model=32", "--json", "-"]
    res = cli(*args, "--lrs", "1e-3,3e-3,1e-2,3e-2", "--steps", "2", *RUN, obj=wired)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["lrs"] == [1e-3, 3e-3, 1e-2, 3e-2]
    assert [r["lr"] for r in data["rows"]] == [1e-3, 3e-3, 1e-2, 3e-2]
    (b,) = data["lr_brackets"]
    assert b["safe"] == 3e-3 and b["flagged"] == 1e-2
    assert [p["trains"] for p in b["points"]] == [True, True, False, False]
    assert b["points"][2]["evidence"] == ["update-size warn: 0.5 (threshold 0.2)"]
    assert data["coord"] is None
    res = cli(*args, "--lrs", "1e-4,3e-4,1e-3", "--steps", "2", *RUN, obj=wired)
    (b,) = json.loads(res.stdout)["lr_brackets"]
    assert b["safe"] == 1e-4 and b["flagged"] == 3e-4  # 1e-3 is quiet, but above a flag


def test_lr_verdict_when_only_the_lowest_lrs_are_flagged() -> None:
    """No safe lr because the lowest is flagged, while a higher one is quiet: the verdict
    names the quiet ones and does not advise lower lrs; all flagged: it does."""
    from actscan.compare.sweep import LrBracket, LrPoint
    from actscan.render.compare import lr_verdict

    def pt(lr: float, trains: bool) -> LrPoint:
        return LrPoint(lr, trains, () if trains else ("logit-drift warn: 12",), 5.5, 4.0)

    sw = SimpleNamespace(sides=("a",))
    low = LrBracket("a", None, None, None, 1e-3, (pt(1e-3, False), pt(3e-3, True), pt(1e-2, False)))
    text = lr_verdict(sw, low).plain  # type: ignore[arg-type]
    assert "no lr is called safe; yet 0.003 looks like runs that trained" in text
    assert "try lower" not in text
    every = LrBracket("a", None, None, None, 1e-3, (pt(1e-3, False), pt(3e-3, False)))
    assert "try lower learning rates" in lr_verdict(sw, every).plain  # type: ignore[arg-type]


# -- the command ------------------------------------------------------------------------------
SWEEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "kind",
        "tool",
        "target",
        "labels",
        "axes",
        "keys",
        "rows",
        "trends",
    ],
    "properties": {
        "schema_version": {"const": 1},
        "kind": {"const": "sweep"},
        "axes": {"type": "object", "required": ["depth", "width"]},
        "keys": {"type": "object", "required": ["depth", "width"]},
        "rows": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": [
                    "side",
                    "depth",
                    "width",
                    "overrides",
                    "final_rms",
                    "growth",
                    "growth_exponent",
                    "gain_per_block",
                    "grad_ratio",
                    "findings",
                    "worst_check",
                    "worst_severity",
                    "report",
                ],
                "properties": {
                    "side": {"enum": ["a", "b"]},
                    "findings": {"type": "object", "required": ["info", "warn", "error"]},
                },
            },
        },
        "trends": {
            "type": "array",
            "items": {
                "required": [
                    "side",
                    "growth_first",
                    "growth_last",
                    "growth_spread",
                    "final_rms_spread",
                ]
            },
        },
    },
}


@pytest.mark.slow
def test_depth_sweep_naive_grows_with_depth_scaled_does_not(isolated: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from actscan.report.schema import validate_report

    out = isolated / "sweep.json"
    res = cli(
        "sweep",
        "gpt-48-naive",
        "--depth",
        "6,12,24",
        "--set",
        "d_model=64",
        "--vs-set",
        "branch_scale=depth",
        "--json",
        str(out),
        *RUN,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    jsonschema.validate(data, SWEEP_SCHEMA)
    for r in data["rows"]:
        validate_report(r["report"])
        assert r["report"]["model"]["n_blocks"] == r["depth"]
        assert r["report"]["model"]["d_model"] == 64
    naive = [r["growth"] for r in data["rows"] if r["side"] == "a"]
    scaled = [r["growth"] for r in data["rows"] if r["side"] == "b"]
    assert naive[0] < naive[1] < naive[2] and naive[2] > 1.8 * naive[0]
    assert max(scaled) / min(scaled) < 1.15
    assert all(s < n for s, n in zip(scaled, naive, strict=True))
    trends = {t["side"]: t for t in data["trends"]}
    assert trends["a"]["growth_spread"] > 1.8 > 1.15 > trends["b"]["growth_spread"]
    # The terminal: one row per side and size, a sparkline, the trend lines.
    assert "depth 24" in res.stdout and "▁" in res.stdout
    assert "B: A --set branch_scale=depth" in res.stdout


def test_width_sweep_builds_each_width(isolated: Path) -> None:
    pytest.importorskip("matplotlib")
    png = isolated / "w.png"
    res = cli(
        "sweep",
        "gpt-12-preln",
        "--width",
        "32,64",
        "--depth",
        "2",
        "--json",
        "-",
        "--plot",
        str(png),
        *RUN,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [(r["depth"], r["width"]) for r in data["rows"]] == [(2, 32), (2, 64)]
    assert [r["report"]["model"]["d_model"] for r in data["rows"]] == [32, 64]
    assert data["keys"] == {"depth": "n_layers", "width": "d_model"}
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_gate_trips_on_any_row(isolated: Path) -> None:
    """A planted error on the deepest model only: the sweep exits 1 at --fail-on error."""

    def checks(ctx: Any) -> tuple[Finding, ...]:
        if ctx.info.n_blocks >= 4:
            return (Finding("exp-growth", Severity.ERROR, ("blocks.3",), 9.0, 4.0, "planted"),)
        return ()

    wired = Wiring(checks=planted_checks(checks))
    args = ["sweep", "gpt-12-preln", "--set", "d_model=32", "--json", "-", *RUN]
    res = cli(*args, "--depth", "2,4", obj=wired)
    assert res.exit_code == 1, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["findings"]["error"] for r in rows] == [0, 1]
    assert rows[1]["worst_check"] == "exp-growth" and rows[1]["worst_severity"] == "error"
    assert cli(*args, "--depth", "2,3", obj=wired).exit_code == 0
    assert cli(*args, "--depth", "2,4", "--fail-on", "never", obj=wired).exit_code == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gpt-12-preln"], "--depth, --width and/or --lrs"),
        (["gpt-12-preln", "--lrs", "1e-3,1e-2"], "add --steps N"),
        (["gpt-12-preln", "--depth", "2,x"], "--depth expects"),
        (["mypkg.models:build", "--depth", "2"], "module:callable"),
        (["missing.yaml", "--depth", "2"], "no such file"),
        (["gpt-12-preln", "--depth", "2", "--vs-dtype", "bf16", "--vs-amp", "fp16"], "autocast"),
        (["gpt-12-preln", "--depth", "2", "--vs-set", "bogus=1"], "--vs-set: unknown key 'bogus'"),
        (["gpt-12-preln", "--depth", "2", "--set", "bogus=1"], "--set: unknown key 'bogus'"),
    ],
)
def test_usage_errors_exit_2(isolated: Path, args: list[str], needle: str) -> None:
    res = cli("sweep", *args, *RUN)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.output


def test_weights_are_refused(isolated: Path) -> None:
    w = isolated / "model.safetensors"
    w.write_bytes(b"\x00" * 16)
    res = cli("sweep", str(w), "--depth", "2", *RUN)
    assert res.exit_code == 2 and "from a config" in res.stderr


def test_depth_moves_both_stacks_of_an_encoder_decoder(tmp_path: Path) -> None:
    """BART/Whisper name their depth encoder_layers + decoder_layers, T5 num_layers +
    num_decoder_layers: a depth sweep sets both, so both streams change together."""
    bart = {"model_type": "bart", "encoder_layers": 2, "decoder_layers": 2, "d_model": 64}
    t5 = {"model_type": "t5", "num_layers": 2, "num_decoder_layers": 2, "d_model": 64}
    for values, keys in (
        (bart, {"encoder_layers", "decoder_layers"}),
        (t5, {"num_layers", "num_decoder_layers"}),
    ):
        path = tmp_path / f"{values['model_type']}.json"
        path.write_text(json.dumps(values))
        assert size_overrides(base_config(str(path), {}), 6, None) == dict.fromkeys(keys, "6")
