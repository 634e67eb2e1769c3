"""Each TARGET kind profiles from the CLI, and each shipped sample shows its planted pathology.

Checkpoint tests compare against the same model scanned directly through the Python API: the
numbers match only if every weight made it from the file into the rebuilt model.
"""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from actscan.cli import app
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.run import scan
from actscan.targets.checkpoint import CONFIG_KEY, save_builtin
from actscan.targets.resolve import resolve
from actscan.targets.safetensors_io import read_header

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
TINY = ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=32, init="fan-in")


def profile(*args: str, tmp: Path, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """Run `actscan profile ARGS` in-process and return the JSON report."""
    out = tmp / "report.json"
    result = CliRunner().invoke(
        app, ["profile", *args, "--json", str(out), "--quiet", "--fail-on", "never"]
    )
    assert result.exit_code in ok, result.output
    return json.loads(out.read_text())


def fail(*args: str) -> str:
    result = CliRunner().invoke(app, ["profile", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return result.stderr


def stream_rms(report: dict[str, Any]) -> list[float]:
    return [p["rms"] for p in report["stream"]]


def layer(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in report["layers"] if r["name"] == name)


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(TINY, seed=3)


@pytest.fixture(scope="module")
def direct(tiny_model: torch.nn.Module) -> list[float]:
    """Stream RMS of the in-memory model: what a faithful checkpoint must reproduce."""
    report = scan(tiny_model, batch=4, seq_len=32, seed=0, backward=False, device="cpu")
    return [p.rms for p in report.stream]


def test_bare_checkpoint_profiles_from_its_header(tmp_path, tiny_model, direct) -> None:
    path = tmp_path / "tiny.safetensors"
    save_builtin(tiny_model, path)
    header = read_header(path)
    assert header.metadata["format"] == "actscan"
    assert json.loads(header.metadata[CONFIG_KEY])["d_model"] == 32
    assert "head.weight" not in header.tensors  # tied head stored once

    report = profile(str(path), "--no-backward", "--device", "cpu", tmp=tmp_path)
    assert report["model"]["family"] == "actscan-gpt"
    assert report["model"]["n_blocks"] == 2
    assert report["model"]["at_init"] is False
    assert stream_rms(report) == pytest.approx(direct, rel=1e-6)

    resolved = resolve(str(path))
    model = resolved.model
    assert model.head.weight is model.tok_emb.weight  # still tied after loading
    for name, t in tiny_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name


def plain_weights(model: torch.nn.Module, path: Path) -> None:
    """A checkpoint without actscan metadata, as another tool would write it."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(sd, str(path))


def test_checkpoint_with_config_option(tmp_path, tiny_model, direct) -> None:
    path = tmp_path / "w.safetensors"
    plain_weights(tiny_model, path)
    assert "architecture" in fail(str(path))  # no metadata, no config: says what to do
    cfg = tmp_path / "arch.yaml"
    cfg.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in TINY.to_dict().items()))
    report = profile(
        str(path), "--config", str(cfg), "--no-backward", "--device", "cpu", tmp=tmp_path
    )
    assert stream_rms(report) == pytest.approx(direct, rel=1e-6)


def test_checkpoint_with_config_json_beside(tmp_path, tiny_model, direct) -> None:
    path = tmp_path / "w.safetensors"
    plain_weights(tiny_model, path)
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_dict()))
    report = profile(str(path), "--no-backward", "--device", "cpu", tmp=tmp_path)
    assert stream_rms(report) == pytest.approx(direct, rel=1e-6)
    assert report["model"]["arch"]["config_source"] == str(tmp_path / "config.json")


def test_fp16_checkpoint_loads_into_fp32(tmp_path, tiny_model) -> None:
    path = tmp_path / "half.safetensors"
    save_builtin(tiny_model, path, dtype=torch.float16)
    assert {e.dtype for e in read_header(path).tensors.values()} == {"F16"}
    model = resolve(str(path)).model
    w = model.blocks[0].mlp.up.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, tiny_model.blocks[0].mlp.up.weight.half().float())


# -- module:callable ---------------------------------------------------------------------


def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    return name


def test_callable_with_input_shape(tmp_path, monkeypatch) -> None:
    mod = write_module(
        tmp_path,
        monkeypatch,
        "fac_mlp",
        """
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    """,
    )
    report = profile(f"{mod}:build", "--input-shape", "5,16", tmp=tmp_path)
    assert report["model"]["family"] == "custom"
    assert report["run"]["batch"] == 5
    # Independent: first layer's output RMS on the same seeded input.
    torch.manual_seed(0)
    from torch import nn

    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    expect = net[0](x).square().mean().sqrt().item()
    assert layer(report, "0")["rms"] == pytest.approx(expect, rel=1e-5)
    assert layer(report, "2")["grad_rms"] is not None  # backward ran with the mean-square loss

    err = fail(f"{mod}:build")  # no example inputs, no embedding: asks for --input-shape
    assert "--input-shape" in err


def test_callable_returning_model_and_inputs(tmp_path, monkeypatch) -> None:
    mod = write_module(
        tmp_path,
        monkeypatch,
        "fac_pair",
        """
        import torch
        from torch import nn

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x, scale=1.0):
                return self.lin(x) * scale

        def with_tensor():
            return Scaled(), torch.ones(3, 8)

        def with_kwargs():
            return Scaled(), {"x": torch.ones(2, 8), "scale": 0.0}
    """,
    )
    report = profile(f"{mod}:with_tensor", tmp=tmp_path)
    assert report["run"]["batch"] == 3
    assert layer(report, "lin")["rms"] > 0
    report = profile(f"{mod}:with_kwargs", "--no-backward", tmp=tmp_path)
    assert report["run"]["batch"] == 2
    assert layer(report, "lin")["rms"] > 0  # the kwargs reached forward: scale 0 applies after
    # --input-shape overrides the example inputs
    report = profile(f"{mod}:with_tensor", "--input-shape", "6,8", tmp=tmp_path)
    assert report["run"]["batch"] == 6


def test_callable_with_embedding_gets_token_ids(tmp_path, monkeypatch) -> None:
    mod = write_module(
        tmp_path,
        monkeypatch,
        "fac_emb",
        """
        from torch import nn

        class TinyLM(nn.Module):
            def __init__(self, out):
                super().__init__()
                self.emb = nn.Embedding(50, 16)
                self.pos = nn.Embedding(12, 16)
                self.head = nn.Linear(16, out)

            def forward(self, ids):
                import torch
                return self.head(self.emb(ids) + self.pos(torch.arange(ids.shape[1])))

        def lm():
            return TinyLM(50)

        def encoder():
            return TinyLM(7)
    """,
    )
    report = profile(f"{mod}:lm", tmp=tmp_path)
    assert report["model"]["task"] == "causal-lm"  # output last dim == vocab: logits
    assert report["model"]["vocab_size"] == 50
    assert report["run"]["seq_len"] == 12  # capped by the smaller (position) embedding
    assert report["run"]["batch"] == 4
    report = profile(f"{mod}:encoder", "--batch", "2", "--seq-len", "10", tmp=tmp_path)
    assert report["model"]["task"] == "custom"
    assert (report["run"]["batch"], report["run"]["seq_len"]) == (2, 10)


def test_callable_returning_builtin_model(tmp_path, monkeypatch) -> None:
    mod = write_module(
        tmp_path,
        monkeypatch,
        "fac_builtin",
        """
        from actscan.models.arch import ArchConfig
        from actscan.models.gpt import build_model

        def gpt():
            return build_model(ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64,
                                          seq_len=16))
    """,
    )
    report = profile(f"{mod}:gpt", "--no-backward", tmp=tmp_path)
    assert report["model"]["family"] == "actscan-gpt"
    assert report["run"]["seq_len"] == 16  # the model's own limit
    assert len(report["stream"]) == 3


# -- --input FILE ------------------------------------------------------------------------


def test_input_token_file(tmp_path, tiny_model) -> None:
    path = tmp_path / "tiny.safetensors"
    save_builtin(tiny_model, path)
    ids = [[(7 * i + j) % 64 for j in range(10)] for i in range(3)]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(ids))
    report = profile(str(path), "--input", str(tokens), "--device", "cpu", tmp=tmp_path)
    assert (report["run"]["batch"], report["run"]["seq_len"]) == (3, 10)
    # Independent: the embedding output RMS on exactly these ids.
    emb = tiny_model.tok_emb(torch.tensor(ids))
    assert layer(report, "tok_emb")["rms"] == pytest.approx(
        emb.square().mean().sqrt().item(), rel=1e-5
    )

    tokens.write_text(json.dumps([[0, 64]]))
    assert "[0, 64)" in fail(str(path), "--input", str(tokens))
    tokens.write_text(json.dumps([list(range(40))]))  # longer than seq_len 32
    assert "32 positions" in fail(str(path), "--input", str(tokens))
    text = tmp_path / "prompt.txt"
    text.write_text("hello")
    assert "tokenizer" in fail(str(path), "--input", str(text))
    (tmp_path / "ids.csv").write_text("1,2,3")
    assert "unsupported" in fail(str(path), "--input", str(tmp_path / "ids.csv"))


def test_input_text_with_hf_tokenizer(tmp_path) -> None:
    text = tmp_path / "prompt.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    folder = SAMPLES / "tiny-gpt2-hf"
    report = profile(
        str(folder),
        "--input",
        str(text),
        "--seq-len",
        "16",
        "--batch",
        "3",
        "--no-backward",
        tmp=tmp_path,
    )
    assert (report["run"]["batch"], report["run"]["seq_len"]) == (3, 16)
    # The byte-level tokenizer maps each byte to its own id: check against the raw bytes.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert tok(text.read_text())["input_ids"][:16] == list(text.read_bytes()[:16])


# -- shipped samples ---------------------------------------------------------------------


SMALL_RUN = ("--batch", "2", "--seq-len", "32", "--device", "cpu")


def sample(name: str) -> str:
    return str(SAMPLES / name)


def test_sample_healthy(tmp_path) -> None:
    rms = stream_rms(profile(sample("healthy.safetensors"), *SMALL_RUN, tmp=tmp_path))
    assert len(rms) == 5
    assert max(rms) / min(rms) < 1.2


def test_sample_outlier_channel(tmp_path) -> None:
    report = profile(
        sample("outlier-channel.safetensors"), "--no-backward", *SMALL_RUN, tmp=tmp_path
    )
    emb = layer(report, "tok_emb")
    assert emb["outlier_channels"] == [17]
    assert emb["max_abs"] >= 6
    assert 17 in layer(report, "blocks.0")["outlier_channels"]  # carried by the stream
    assert (
        layer(
            profile(sample("healthy.safetensors"), "--no-backward", *SMALL_RUN, tmp=tmp_path),
            "tok_emb",
        )["outlier_channels"]
        == []
    )


def test_sample_dead_branch(tmp_path) -> None:
    report = profile(sample("dead-branch.safetensors"), *SMALL_RUN, tmp=tmp_path)
    assert layer(report, "blocks.2.mlp")["rms"] == 0.0
    assert layer(report, "blocks.2.mlp.up")["rms"] > 0  # the branch runs; its output is zero
    for i in (0, 1, 3):
        assert layer(report, f"blocks.{i}.mlp")["rms"] > 1e-3
    branch = next(b for b in report["branches"] if (b["block"], b["kind"]) == (2, "mlp"))
    assert branch["rms"] == 0.0 and branch["ratio"] == 0.0


@pytest.mark.slow
def test_sample_gpt_48_naive(tmp_path) -> None:
    report = profile(sample("gpt-48-naive.safetensors"), "--no-backward", *SMALL_RUN, tmp=tmp_path)
    assert report["model"]["n_blocks"] == 48
    rms = stream_rms(report)
    assert len(rms) == 49
    assert rms[-1] / rms[0] > 3  # unscaled branches pile up
    quarters = rms[::12]  # k = 0, 24, 48, 72, 96
    assert all(b > a for a, b in itertools.pairwise(quarters))


def test_sample_fp16_overflow(tmp_path) -> None:
    path = sample("fp16-overflow.safetensors")
    fp32 = profile(path, "--dtype", "fp32", "--no-backward", *SMALL_RUN, tmp=tmp_path)
    fp16 = profile(path, "--dtype", "fp16", "--no-backward", *SMALL_RUN, tmp=tmp_path)
    assert sum(r["nonfinite"] for r in fp32["layers"]) == 0
    assert layer(fp32, "blocks.1.mlp.down")["max_abs"] > 65504
    assert layer(fp16, "blocks.1.mlp.down")["nonfinite"] > 0
    assert layer(fp16, "blocks.0.mlp.down")["nonfinite"] == 0  # it starts at block 1


def test_sample_tiny_gpt2_hf(tmp_path) -> None:
    report = profile(sample("tiny-gpt2-hf"), "--no-backward", *SMALL_RUN, tmp=tmp_path)
    assert report["model"]["family"] == "gpt2"
    assert report["model"]["n_blocks"] == 2
    assert len(report["stream"]) == 3


def test_samples_match_their_generator(tmp_path) -> None:
    """The committed files are what make_samples.py writes (same tensors, same config)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_samples", SAMPLES / "make_samples.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, make in gen.SAMPLES.items():
        path = tmp_path / f"{name}.safetensors"
        dtype = torch.float16 if name in gen.FP16_STORED else None
        save_builtin(make(), path, dtype=dtype)
        assert gen._content(path) == gen._content(SAMPLES / f"{name}.safetensors"), name
        assert (SAMPLES / f"{name}.safetensors").stat().st_size <= gen.MAX_BYTES
