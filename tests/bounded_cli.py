"""Run many `actscan` command lines in one child process, each under a hang guard, the
whole batch under an address-space limit: for tests whose inputs could block or fill
memory on a broken build (alias bombs, FIFOs, /dev/zero, huge configs).

`run_batch(cases)` starts one Python child (one start-up for the batch, not one per case)
that sets RLIMIT_AS to what it has mapped plus `memory` bytes, then runs each case
in process through typer's CliRunner with a SIGALRM after `per_case` seconds (the alarm
interrupts a blocking open or read as well as a Python loop), and reports for each case
its exit code, stderr, stdout and wall time, or "hang" when the alarm fired.

The child is itself killed after `total` seconds, so no test can wait forever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def run_batch(
    cases: dict[str, list[str]],
    *,
    per_case: float = 60.0,
    memory: int = 3 * GiB,
    total: float = 600.0,
    cwd: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """{case name: {"code", "stderr", "stdout", "seconds"}} ("code" "hang" on a hang)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NO_COLOR": "1",
        "COLUMNS": "200",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("ACTSCAN_DEBUG", None)
    job = json.dumps({"cases": cases, "per_case": per_case, "memory": memory})
    proc = subprocess.run(
        [sys.executable, __file__],
        input=job,
        capture_output=True,
        text=True,
        timeout=total,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


class Hang(BaseException):
    """The per-case alarm: a BaseException, so no `except Exception` in actscan eats it."""


def _mapped() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        line = next(ln for ln in fh if ln.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def _child() -> None:
    import resource
    import signal
    import time

    import torch
    from typer.testing import CliRunner

    import actscan.targets.hf  # noqa: F401  (loaded before the limit: its imports map a lot)
    from actscan.cli import app

    torch.set_num_threads(1)
    job = json.loads(sys.stdin.read())
    limit = _mapped() + int(job["memory"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def alarm(_signum: int, _frame: object) -> None:
        raise Hang

    signal.signal(signal.SIGALRM, alarm)
    out: dict[str, dict[str, Any]] = {}
    for name, args in job["cases"].items():
        start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, float(job["per_case"]))
        try:
            result = CliRunner().invoke(app, args)
            code: Any = result.exit_code
            stderr, stdout = result.stderr, result.stdout
        except Hang:
            code, stderr, stdout = "hang", "", ""
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out[name] = {
            "code": code,
            "stderr": stderr,
            "stdout": stdout[-2000:],
            "seconds": time.perf_counter() - start,
        }
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    _child()
