"""Every bad input from the CLI: exit code 2, one `actscan: error:` line naming the file or
tensor, no traceback (unless ACTSCAN_DEBUG=1), and the user's files byte-for-byte unchanged.
"""

from __future__ import annotations

import hashlib
import json
import struct
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from actscan.cli import app
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.targets.checkpoint import CONFIG_KEY, save_builtin
from actscan.targets.safetensors_io import load_tensors, save_tensors

TINY = ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16, init="fan-in")
FAST = ["--no-backward", "--batch", "2", "--seq-len", "8", "--device", "cpu"]


def digest(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def refuse(args: list[str], *expect: str, files: Path | None = None, env=None) -> str:
    """Run `actscan ARGS`; assert exit 2, one error line containing every `expect`."""
    before = digest(files) if files is not None and files.exists() else None
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("actscan: error: "), lines[0]
    for text in expect:
        assert text in lines[0], lines[0]
    if before is not None:
        assert digest(files) == before  # type: ignore[arg-type]
    return lines[0]


def raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file from parts; `length` overrides the 8-byte header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.safetensors"
    save_builtin(build_model(TINY, seed=0), path)
    return path


def test_missing_path(tmp_path) -> None:
    refuse(["profile", str(tmp_path / "nope.safetensors")], "no such file", "nope.safetensors")


def test_empty_and_configless_folder(tmp_path, good) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse(["profile", str(empty)], str(empty), "config.json", files=empty)
    noconf = tmp_path / "noconf"
    noconf.mkdir()
    (noconf / "model.safetensors").write_bytes(good.read_bytes())
    refuse(["profile", str(noconf)], str(noconf), "config.json", "--config", files=noconf)


def test_truncated_file(tmp_path, good) -> None:
    data = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    refuse(["profile", str(cut)], "cut.safetensors", "truncated", files=cut)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(data[:5])
    refuse(["profile", str(tiny)], "tiny.safetensors", "truncated", files=tiny)


def test_header_length_beyond_file(tmp_path) -> None:
    path = raw_file(tmp_path / "long.safetensors", {}, length=10_000)
    refuse(["profile", str(path)], "long.safetensors", "larger than the file", files=path)


def test_header_over_100mb(tmp_path) -> None:
    path = raw_file(tmp_path / "huge.safetensors", {}, length=200_000_000)
    refuse(["profile", str(path)], "huge.safetensors", "exceeds", files=path)


@pytest.mark.parametrize(
    ("header", "expect"),
    [
        (b"{not json}", "not valid JSON"),
        (b"[1, 2, 3]", "expected a JSON object"),
        (b'"text"    ', "expected a JSON object"),
        (b'{"a": 1}', "expected a tensor entry"),
    ],
)
def test_header_not_json_object(tmp_path, header, expect) -> None:
    path = raw_file(tmp_path / "h.safetensors", header)
    refuse(["profile", str(path)], "h.safetensors", expect, files=path)


def entry(start: int, end: int, shape: list[int], dtype: str = "F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


@pytest.mark.parametrize(
    ("tensors", "data_len", "expect"),
    [
        (
            {"a": entry(0, 16, [4]), "b": entry(8, 24, [4])},
            24,
            "'b' does not start where the previous",
        ),
        ({"a": entry(0, 16, [4]), "b": entry(16, 48, [8])}, 32, "do not cover the 32-byte data"),
        ({"a": entry(0, 16, [4]), "b": entry(20, 36, [4])}, 36, "must be contiguous"),
        ({"a": entry(0, 16, [4])}, 24, "unused bytes"),
        ({"a": entry(0, 16, [5])}, 16, "shape × dtype size differs from its byte range"),
        ({"a": entry(0, 8, [4], "U16")}, 8, "unsupported dtype 'U16'"),
        ({"a": entry(0, 8, [4], "Q7")}, 8, "unknown dtype 'Q7'"),
    ],
)
def test_bad_tensor_layout(tmp_path, tensors, data_len, expect) -> None:
    path = raw_file(tmp_path / "t.safetensors", tensors, b"\0" * data_len)
    refuse(["profile", str(path)], "t.safetensors", expect, files=path)


def with_config(tmp_path: Path, good: Path, name: str, **change: object) -> Path:
    """`good`'s tensors under a header config with some fields changed."""
    path = tmp_path / name
    cfg = {**TINY.to_dict(), **change}
    save_tensors(
        load_tensors(good), path, metadata={"format": "actscan", CONFIG_KEY: json.dumps(cfg)}
    )
    return path


def test_shape_mismatch_vs_config(tmp_path, good) -> None:
    cfg = tmp_path / "wide.yaml"
    cfg.write_text("n_layers: 2\nd_model: 64\nn_heads: 4\nvocab_size: 64\nseq_len: 16\n")
    want = "'blocks.0.attn.proj.weight' file [32, 32] vs model [64, 64]"
    refuse(
        ["profile", str(good), "--config", str(cfg), *FAST],
        "good.safetensors",
        "mis-shaped",
        want,
        files=good.parent,
    )
    path = with_config(tmp_path, good, "deep.safetensors", n_layers=3)
    refuse(["profile", str(path)], "deep.safetensors", "n_layers=3", "2 blocks", files=path)


def test_missing_and_unexpected_keys(tmp_path, good) -> None:
    tensors = load_tensors(good)
    meta = {"format": "actscan", CONFIG_KEY: json.dumps(TINY.to_dict())}
    missing = tmp_path / "missing.safetensors"
    save_tensors({k: v for k, v in tensors.items() if k != "blocks.1.mlp.up.weight"}, missing, meta)
    refuse(
        ["profile", str(missing), *FAST],
        "missing.safetensors",
        "missing 1",
        "'blocks.1.mlp.up.weight'",
        files=missing,
    )
    extra = tmp_path / "extra.safetensors"
    save_tensors({**tensors, "blocks.0.extra.weight": torch.zeros(2)}, extra, meta)
    refuse(
        ["profile", str(extra), *FAST],
        "extra.safetensors",
        "unexpected 1",
        "'blocks.0.extra.weight'",
        files=extra,
    )
    # A tied head stored under both names is fine.
    both = tmp_path / "both.safetensors"
    save_tensors({**tensors, "head.weight": tensors["tok_emb.weight"]}, both, meta)
    result = CliRunner().invoke(app, ["profile", str(both), *FAST, "--quiet"])
    assert result.exit_code == 0, result.output


def test_nonfinite_weights(tmp_path, good) -> None:
    tensors = load_tensors(good)
    bad = tensors["blocks.0.attn.qkv.weight"].clone()
    bad[0, :3] = float("nan")
    bad[1, 0] = float("inf")
    meta = {"format": "actscan", CONFIG_KEY: json.dumps(TINY.to_dict())}
    path = tmp_path / "nan.safetensors"
    save_tensors({**tensors, "blocks.0.attn.qkv.weight": bad}, path, meta)
    refuse(
        ["profile", str(path), *FAST],
        "nan.safetensors",
        "'blocks.0.attn.qkv.weight' 4",
        "--allow-nonfinite",
        files=path,
    )
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            "profile",
            str(path),
            *FAST,
            "--allow-nonfinite",
            "--quiet",
            "--json",
            str(out),
            "--fail-on",
            "never",
        ],
    )
    assert result.exit_code == 0, result.output
    notes = json.loads(out.read_text())["notes"]
    assert any("non-finite" in n and "blocks.0.attn.qkv.weight" in n for n in notes)


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pickle_checkpoint(tmp_path, suffix) -> None:
    path = tmp_path / f"model{suffix}"
    torch.save({"w": torch.zeros(2)}, path)
    refuse(["profile", str(path)], f"model{suffix}", "pickle", "safetensors", files=path)
    disguised = tmp_path / "model.safetensors"  # a pickle under the wrong name
    disguised.write_bytes(path.read_bytes())
    refuse(["profile", str(disguised)], "model.safetensors", "pickle", files=disguised)


@pytest.mark.parametrize(
    ("name", "text", "expect"),
    [
        ("bad.yaml", "n_layers: [2\n", "malformed YAML"),
        ("bad.toml", "n_layers = = 2\n", "malformed TOML"),
        ("bad.json", '{"n_layers": 2,', "malformed JSON"),
        ("typo.yaml", "n_layers: 2\nd_modle: 32\n", "unknown key 'd_modle'"),
        ("list.yaml", "- 1\n- 2\n", "expected a mapping"),
    ],
)
def test_malformed_config(tmp_path, good, name, text, expect) -> None:
    cfg = tmp_path / name
    cfg.write_text(text)
    refuse(["profile", str(cfg)], name, expect, files=cfg)
    refuse(["profile", str(good), "--config", str(cfg)], name, expect, files=cfg)


def test_bad_config_in_checkpoint_header(tmp_path, good) -> None:
    path = tmp_path / "h.safetensors"
    meta = {"format": "actscan", CONFIG_KEY: "{not json"}
    save_tensors(load_tensors(good), path, meta)
    refuse(["profile", str(path)], "h.safetensors", CONFIG_KEY, "not valid JSON", files=path)
    path = with_config(tmp_path, good, "k.safetensors", bogus=1)
    refuse(["profile", str(path)], "k.safetensors", "unknown key 'bogus'", files=path)


def test_checkpoint_without_architecture(tmp_path, good) -> None:
    path = tmp_path / "plain.safetensors"
    save_tensors(load_tensors(good), path)
    refuse(["profile", str(path)], "plain.safetensors", "--config", files=path)
    refuse(["profile", str(good), "--config", str(tmp_path / "nope.yaml")], "nope.yaml")


def test_init_on_checkpoint_is_refused(good) -> None:
    refuse(["profile", str(good), "--init", "xavier"], "--init", "good.safetensors")


def test_unwritable_json_path(tmp_path, good) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    target = blocker / "report.json"  # a path under a file
    refuse(["profile", str(good), *FAST, "--json", str(target)], str(target), files=blocker)


@pytest.mark.slow
def test_bad_input_files(tmp_path, good) -> None:
    refuse(["profile", str(good), "--input", str(tmp_path / "no.json")], "no.json", "not found")
    bad = tmp_path / "ids.json"
    bad.write_text('{"ids": [1, 2]}')
    refuse(["profile", str(good), "--input", str(bad)], "ids.json", files=bad)
    ragged = tmp_path / "ragged.json"
    ragged.write_text("[[1, 2], [3]]")
    refuse(["profile", str(good), "--input", str(ragged)], "ragged.json", "same length")


# -- module:callable -----------------------------------------------------------------------

FACTORIES = """
import torch
from torch import nn

def raises():
    raise ValueError("no weights here")

def wrong_type():
    return 42

def wrong_tuple():
    return nn.Linear(2, 2), torch.ones(2), 3

def wrong_inputs():
    return nn.Linear(2, 2), [torch.ones(2)]

def needs_args(width):
    return nn.Linear(width, width)

def no_embedding():
    return nn.Linear(4, 4)

def too_big():  # 2^43 floats: the allocator refuses at once (no memory is touched)
    return nn.Linear(2**22, 2**21)

not_callable = 3
"""


@pytest.mark.parametrize(
    ("target", "expect"),
    [
        ("no_such_pkg_xyz:build", "no module named 'no_such_pkg_xyz'"),
        ("facs_bad:missing", "has no attribute 'missing'"),
        ("facs_bad:raises", "ValueError: no weights here"),
        ("facs_bad:wrong_type", "returned int"),
        ("facs_bad:wrong_tuple", "tuple of 3"),
        ("facs_bad:wrong_inputs", "example inputs are a list"),
        ("facs_bad:needs_args", "TypeError"),
        ("facs_bad:no_embedding", "--input-shape"),
        ("facs_bad:not_callable", "not a callable"),
        ("facs_bad:too_big", "calling it hit out of memory (tried to allocate 35.2 TB): make"),
        ("facs_syntax:build", "SyntaxError"),
        ("facs_importerr:build", "No module named 'missing_dependency_xyz'"),
        ("facs bad:build", "package.module:callable"),
    ],
)
def test_bad_factory(tmp_path, monkeypatch, target, expect) -> None:
    (tmp_path / "facs_bad.py").write_text(textwrap.dedent(FACTORIES))
    (tmp_path / "facs_syntax.py").write_text("def build(:\n    pass\n")
    (tmp_path / "facs_importerr.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    refuse(["profile", target], expect, files=tmp_path)


def test_debug_shows_traceback(tmp_path) -> None:
    result = CliRunner().invoke(
        app, ["profile", str(tmp_path / "nope.safetensors")], env={"ACTSCAN_DEBUG": "1"}
    )
    assert result.exit_code == 2
    assert "Traceback" in result.output
    assert "actscan: error: no such file" in result.stderr
