"""Outputs only where the user pointed: `--json`, `-o` and `--plot` write regular files
(or `-`, stdout), and anything else is refused with one line and exit 2 before any model
is built, never replaced.

No real device node is touched: a FIFO stands for every special file (device, socket and
FIFO are refused by the same test of the file's type), and a symlink to a file in tmp_path
for every symlink (`--json /dev/null` as root was the case that mattered).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import one_line_error
from typer.testing import CliRunner

import actscan.api
from actscan.cli import app
from actscan.errors import UsageError
from actscan.report.output import write_atomic

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")

TINY = ["gpt-12-preln", "--set", "n_layers=2", "--set", "d_model=32", "--set", "n_heads=2"]
SMALL_RUN = ["--seq-len", "8", "--batch", "2"]
COMMANDS = {
    "profile": ["profile", *TINY, *SMALL_RUN],
    "compare": ["compare", *TINY, "--vs-set", "n_layers=3", *SMALL_RUN],
    "sweep": ["sweep", "gpt-12-preln", "--width", "32,64", *SMALL_RUN],
}
OLD = "the user's own file\n"


# Every name ends in .png, an image type --plot draws, so each flag takes each path.
def _fifo(tmp: Path) -> Path:
    path = tmp / "out.png"
    os.mkfifo(path)
    return path


def _symlink(tmp: Path) -> Path:
    (tmp / "mine.txt").write_text(OLD)
    os.symlink(tmp / "mine.txt", tmp / "link.png")
    return tmp / "link.png"


def _dangling(tmp: Path) -> Path:
    os.symlink(tmp / "nowhere.png", tmp / "dangling.png")
    return tmp / "dangling.png"


def _folder(tmp: Path) -> Path:
    (tmp / "adir.png").mkdir()
    return tmp / "adir.png"


def _missing_folder(tmp: Path) -> Path:
    return tmp / "no" / "such" / "out.png"


def _under_a_file(tmp: Path) -> Path:
    (tmp / "file.txt").write_text(OLD)
    return tmp / "file.txt" / "out.png"


# name → (make the path, words of the refusal line)
BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (_fifo, "it is a FIFO, not a regular file"),
    "symlink": (_symlink, "it is a symbolic link"),
    "dangling-symlink": (_dangling, "it is a symbolic link"),
    "folder": (_folder, "it is a folder"),
    "missing-folder": (_missing_folder, "does not exist"),
    "parent-is-a-file": (_under_a_file, "file.txt is not a folder"),
}


def _snapshot(tmp: Path) -> dict[str, tuple[int, str | None]]:
    """Every entry under tmp: its type bits and (links: where to; files: what) text."""
    out: dict[str, tuple[int, str | None]] = {}
    for p in sorted(tmp.rglob("*")):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            body: str | None = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            body = p.read_text()
        else:
            body = None
        out[str(p.relative_to(tmp))] = (stat.S_IFMT(st.st_mode), body)
    return out


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The targets the commands go on to build (the real build runs): empty means the
    refusal came before any model existed."""
    seen: list[str] = []
    real = actscan.api.build_target

    def spy(spec: Any, settings: Any) -> Any:
        seen.append(spec.target)
        return real(spec, settings)

    monkeypatch.setattr(actscan.api, "build_target", spy)
    yield seen


def _flag_args(flag: str, path: Path) -> list[str]:
    """`-o` writes the --format document; the others write their own."""
    if flag == "-o":
        return ["--format", "markdown", "-o", str(path)]
    return [flag, str(path)]


CASES = [
    (command, flag, bad)
    for command in COMMANDS
    for flag in ("--json", "-o", "--plot")
    for bad in BAD
]


@pytest.mark.parametrize(("command", "flag", "bad"), CASES)
def test_bad_output_path_is_refused_before_the_build(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    builds: list[str],
    command: str,
    flag: str,
    bad: str,
) -> None:
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    make, words = BAD[bad]
    path = make(tmp_path)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(app, [*COMMANDS[command], *_flag_args(flag, path)])
    line = one_line_error(result, f"cannot write {path}: ", words)
    assert builds == [], line  # refused up front, not after a long scan
    assert _snapshot(tmp_path) == before  # nothing replaced, created or left behind


def test_the_symlink_and_its_file_are_left_as_they_were(tmp_path: Path) -> None:
    link = _symlink(tmp_path)
    with pytest.raises(UsageError, match="symbolic link"):
        write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "mine.txt")
    assert (tmp_path / "mine.txt").read_text() == OLD


def test_the_writer_refuses_what_became_special_after_the_check(tmp_path: Path) -> None:
    """The pre-check passed on a regular file that is then swapped for a FIFO or a symlink:
    write_atomic looks again and refuses instead of replacing it."""
    from actscan.report.output import check_writable

    target = tmp_path / "report.json"
    check_writable(target)  # a new file in a writable folder: fine
    os.mkfifo(target)
    with pytest.raises(UsageError, match="FIFO"):
        write_atomic(target, "{}")
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    os.unlink(target)
    (tmp_path / "other").write_text(OLD)
    os.symlink(tmp_path / "other", target)
    with pytest.raises(UsageError, match="symbolic link"):
        write_atomic(target, "{}")
    assert target.is_symlink() and (tmp_path / "other").read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "report.json"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_folder_and_read_only_file_are_refused_up_front(
    tmp_path: Path, builds: list[str]
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    kept = tmp_path / "kept.json"
    kept.write_text(OLD)
    kept.chmod(0o444)
    ro.chmod(0o500)
    try:
        for path, words in ((ro / "r.json", "is not writable"), (kept, "read-only")):
            result = CliRunner().invoke(app, [*COMMANDS["profile"], "--json", str(path)])
            one_line_error(result, f"cannot write {path}: ", words)
        assert builds == [] and kept.read_text() == OLD
    finally:
        ro.chmod(0o700)


def test_regular_files_and_stdout_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builds: list[str]
) -> None:
    """The control: a new file, an existing regular file (replaced) and `-` pass the check
    and the run writes them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.md").write_text(OLD)
    result = CliRunner().invoke(
        app,
        [*COMMANDS["profile"], "--json", "new.json", "--format", "markdown", "-o", "old.md"],
    )
    assert result.exit_code in (0, 1), result.output
    assert builds == ["gpt-12-preln"]
    assert (tmp_path / "new.json").read_text().startswith("{")
    assert (tmp_path / "old.md").read_text() != OLD
    result = CliRunner().invoke(app, [*COMMANDS["profile"], "--json", "-", "-q"])
    assert result.exit_code in (0, 1) and result.stdout.lstrip().startswith("{")
