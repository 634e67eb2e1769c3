"""Distributed faults name what failed: the rank, its host, its error, signal, exit code
or hang, in one line on the launcher's stderr, with exit 2; never a peer's "Connection
reset by peer", never the FSDP wrapper's class name.

The launched tests run a tiny built-in model on 2 gloo ranks with a fault planted in
rank 1 (or every rank) through a `sitecustomize` module: killed by SIGKILL, exiting with
a code of its own, hanging, raising. Each job has a hang guard of 300 s (≥ 4× what it
takes on a loaded 2-core machine, ~25 s).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from actscan.distributed import faults

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)

JOB_TIMEOUT_S = 300  # a hang guard per job, not a speed bound
HOST = socket.gethostname()
TINY = """family: actscan-gpt
n_layers: 2
d_model: 16
n_heads: 2
vocab_size: 32
seq_len: 8
"""
# FAULT in the ranks FAULT_RANKS (comma-separated), at the model's first forward
SITE = """import os
fault = os.environ.get("FAULT", "")
if fault and os.environ.get("RANK") in os.environ.get("FAULT_RANKS", "1").split(","):
    import signal, time
    import actscan.measure.profile as s
    from torch import nn

    class Broken(nn.Module):
        def forward(self, *a, **k):
            raise ValueError(f"rank {os.environ['RANK']} broke on purpose")

    _orig = s.call_model

    def faulty(model, b):
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "exit":
            os._exit(7)
        if fault == "hang":
            time.sleep(10**6)
        return _orig(Broken(), b)

    s.call_model = faulty
    if fault == "slow-emit":  # rank 0 takes its time writing the reports, rank 1 none
        import actscan.cli.options as o
        import torch.distributed as dist

        _emit = o.emit
        o.emit = lambda *a, **k: (time.sleep(2), _emit(*a, **k))[1]
        if os.environ["RANK"] != "0":  # its group's teardown does not wait for rank 0's
            dist.destroy_process_group = lambda *a, **k: None
        s.call_model = _orig
"""


def _job(
    tmp_path: Path, fault: str, ranks: str = "1", *extra: str, torchrun: bool = False
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tiny.yaml").write_text(TINY)
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        FAULT=fault,
        FAULT_RANKS=ranks,
    )
    args = ["profile", str(tmp_path / "tiny.yaml"), "--batch", "2", "--seq-len", "8", "-q"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["-m", "actscan", *args, *extra]
    else:
        cmd = [sys.executable, "-m", "actscan", *args, "--nproc", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("kill", f"rank 1 (host {HOST}) was killed by signal 9 (SIGKILL)"),
        ("exit", f"rank 1 (host {HOST}) exited with code 7 without reporting an error"),
    ],
)
def test_a_rank_that_dies_without_a_word_is_named_by_the_launcher(
    tmp_path: Path, fault: str, says: str
) -> None:
    res = _job(tmp_path, fault)
    assert res.returncode == 2, res.stderr
    assert _lines(res.stderr) == [f"actscan: error: {says}"], res.stderr


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_at_the_timeout(tmp_path: Path) -> None:
    res = _job(tmp_path, "hang", "1", "--dist-timeout", "5")
    assert res.returncode == 2, res.stderr
    assert _lines(res.stderr) == [
        f"actscan: error: rank 1 (host {HOST}) did not respond for 5 s (--dist-timeout): "
        "hung, or stuck in a different collective"
    ], res.stderr


@pytest.mark.slow
def test_every_rank_failing_at_once_gives_one_line_naming_a_rank(tmp_path: Path) -> None:
    res = _job(tmp_path, "raise", "0,1")
    assert res.returncode == 2, res.stderr
    (line,) = _lines(res.stderr)
    rank = next(r for r in (0, 1) if line.startswith(f"actscan: error: rank {r} (host {HOST}): "))
    assert line.endswith(f"ValueError: rank {rank} broke on purpose"), line


@pytest.mark.slow
def test_plain_torchrun_shows_actscans_line_first_and_in_its_summary(tmp_path: Path) -> None:
    res = _job(tmp_path, "raise", "1", torchrun=True)
    assert res.returncode != 0, res.stderr  # torchrun's own exit code (1) on any failure
    line = f"actscan: error: rank 1 (host {HOST}): Broken failed on 1×8 tokens: "
    assert _lines(res.stderr)[0].startswith(line), res.stderr
    summary = res.stderr[res.stderr.index("Root Cause") :]
    # torchrun's "first observed failure" is whichever error file it reads first: rank 1's
    # own line, or rank 0's (stopped by the agent) pointing at it; never a peer's error
    stopped = "traceback : stopped after rank 1 failed (its line is above)"
    assert f"traceback : {line}" in summary or stopped in summary, res.stderr
    assert "Connection" not in summary, res.stderr


@pytest.mark.slow
def test_findings_exit_1_waits_for_rank_0_to_write_the_report(tmp_path: Path) -> None:
    """Exit 1 (findings) is a failure to torchrun's agent: a rank leaving with it before
    rank 0 has written the reports got rank 0 stopped (SIGTERM), its JSON never written."""
    out = tmp_path / "r.json"
    gate = ("--set", "init=kaiming", "--fail-on", "warn", "--json", str(out))
    res = _job(tmp_path, "slow-emit", "0,1", *gate)
    assert res.returncode == 1, res.stderr
    assert _lines(res.stderr) == [], res.stderr
    assert "logit-scale" in out.read_text()


# -- no launch -------------------------------------------------------------------------------
def _failure(exitcode: int, note: dict[str, Any] | None = None) -> Any:
    data = {"message": "x", "actscan": note} if note is not None else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data)


def test_launcher_verdict_names_the_first_rank_that_died_not_the_ones_it_stopped() -> None:
    sig = -int(signal.SIGTERM)
    # rank 1 killed; the agent then stopped rank 0 (SIGTERM), which had lost its peer
    lost = {"kind": "lost", "printed": False, "code": 2, "line": ""}
    line, code = faults.launcher_verdict({1: _failure(-9), 0: _failure(sig, lost)})
    assert code == 2
    assert line == f"actscan: error: rank 1 (host {HOST}) was killed by signal 9 (SIGKILL)"
    # observed in one poll: rank 0 first, but SIGTERM is the agent's own
    line, _ = faults.launcher_verdict({0: _failure(sig), 1: _failure(-11)})
    assert line is not None and "rank 1" in line and "signal 11 (SIGSEGV)" in line
    # a rank printed its own line: nothing more, its code
    own = {"kind": "own", "printed": True, "code": 3, "line": "actscan: error: rank 1 …"}
    assert faults.launcher_verdict({1: _failure(3, own), 0: _failure(sig)}) == (None, 3)
    # every rank exited with actscan's code before its session began: rank 0 said why
    assert faults.launcher_verdict({0: _failure(2), 1: _failure(2)}) == (None, 2)
    assert faults.launcher_verdict({0: _failure(1), 1: _failure(1)}) == (None, 1)
    # findings (exit 1): rank 1 left first, the agent stopped rank 0 after it had finished
    done = {"kind": "done", "printed": True, "code": 1, "line": ""}
    assert faults.launcher_verdict({1: _failure(1, done), 0: _failure(sig, done)}) == (None, 1)


def test_peer_errors_are_told_from_a_ranks_own() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    assert faults.peer_error(gloo) and not faults.timed_out(gloo)
    timeout = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting"
    )
    assert faults.peer_error(timeout) and faults.timed_out(timeout)
    wrapped = ValueError("the model failed")
    wrapped.__cause__ = torch.distributed.DistBackendError("NCCL watchdog")
    assert faults.peer_error(wrapped)
    assert not faults.peer_error(RuntimeError("shapes (2, 3) and (4, 5) do not match"))
    assert not faults.peer_error(ValueError("timed out"))


def test_only_the_error_line_is_held_back() -> None:
    import io

    from actscan.distributed.runtime import _HoldErrors

    out = io.StringIO()
    held = _HoldErrors(out)
    held.write("a warning\n")
    held.write("actscan: error: the model broke")  # print() writes the newline apart
    held.write("\n")
    held.write("progress\r")
    assert out.getvalue() == "a warning\nprogress\r"
    assert held.held == ["actscan: error: the model broke"]


@pytest.mark.slow  # a gloo group and FSDP2: ~4 s here
def test_messages_name_the_models_class_not_fsdps(tmp_path: Path) -> None:
    """FSDP2 swaps the class for FSDPActscanGPT: the failing model is still ActscanGPT."""
    import torch.distributed as dist

    from actscan.distributed.fsdp import shard_model
    from actscan.measure.inputs import Batch
    from actscan.measure.prepare import call_model, class_name, model_error_line
    from actscan.models.arch import ArchConfig
    from actscan.models.gpt import build_model

    model = build_model(ArchConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        shard_model(model, ["blocks.0", "blocks.1"], torch.device("cpu"))
        assert type(model).__name__ == "FSDPActscanGPT" and class_name(model) == "ActscanGPT"
        with pytest.raises(Exception) as caught:
            call_model(model, Batch((torch.full((1, 8), 99),), {}))  # ids past the vocab
    finally:
        dist.destroy_process_group()
    line = model_error_line(caught.value)
    assert line is not None and line.startswith("ActscanGPT failed on 1×8 tokens"), line


def test_an_absurd_nproc_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--nproc 100000` once started 100000 interpreters: it must be refused before torchrun."""
    import torch.distributed.run as trun
    from typer.testing import CliRunner

    from actscan.cli import app
    from actscan.distributed import launch

    def never(*_: object, **__: object) -> None:
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(trun, "run", never)
    result = CliRunner().invoke(app, ["profile", "gpt-12-preln", "--nproc", "100000"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actscan: error: --nproc 100000:")
    assert str(launch.max_ranks()) in lines[0]
