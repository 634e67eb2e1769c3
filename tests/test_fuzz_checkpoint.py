"""Property: whatever bytes a checkpoint holds, `actscan profile` profiles it (exit 0/1) or
refuses it in one line (exit 2) — never an internal error (3), a crash, or a traceback.

Mutations are aimed mostly at the header (where the parser's decisions are) and partly at
the data section (NaN/Inf or huge weights must be refused or measured, not crash the run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from actscan.cli import app
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.targets.checkpoint import save_builtin
from actscan.targets.safetensors_io import read_header

TINY = ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16, init="fan-in")


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int, Path]:
    """(file bytes, header end offset, a scratch folder) for a valid tiny checkpoint."""
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "valid.safetensors"
    save_builtin(build_model(TINY, seed=1), path)
    return path.read_bytes(), read_header(path).data_offset, folder


@st.composite
def mutation(draw: st.DrawFn, size: int, header_end: int) -> tuple[str, int, bytes, int]:
    """(kind, position, bytes, count): position mostly inside the 8-byte length + header."""
    kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
    in_header = draw(st.booleans()) or draw(st.booleans())  # 3 in 4 aim at the header
    hi = header_end - 1 if in_header else size - 1
    lo = 0 if in_header else header_end
    pos = draw(st.integers(lo, hi))
    data = draw(st.binary(min_size=1, max_size=4))
    count = draw(st.integers(1, 16))
    return kind, pos, data, count


def mutate(raw: bytes, m: tuple[str, int, bytes, int]) -> bytes:
    kind, pos, data, count = m
    if kind == "flip":
        out = bytearray(raw)
        for i, b in enumerate(data):
            if pos + i < len(out):
                out[pos + i] ^= b or 0xFF
        return bytes(out)
    if kind == "insert":
        return raw[:pos] + data + raw[pos:]
    if kind == "delete":
        return raw[:pos] + raw[pos + count :]
    return raw[:pos]


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_mutated_checkpoint_never_crashes(valid: tuple[bytes, int, Path], data: st.DataObject):
    raw, header_end, folder = valid
    m = data.draw(mutation(len(raw), header_end))
    path = folder / "mutated.safetensors"
    bad = mutate(raw, m)
    path.write_bytes(bad)
    result = CliRunner().invoke(
        app,
        [
            "profile",
            str(path),
            "--no-backward",
            "--quiet",
            "--batch",
            "2",
            "--seq-len",
            "8",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code in (0, 1, 2), (m, result.output)
    assert "Traceback" not in result.output, (m, result.output)
    if result.exit_code == 2:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("actscan: error: "), (m, result.stderr)
    assert path.read_bytes() == bad  # the user's file is never written
