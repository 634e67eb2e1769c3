"""actscan installed from a wheel, not from the checkout, works (issue: `pip install actscan`
once shipped no configs, and editable installs hid it).

The test builds a wheel from a copy of the sources, installs it into a fresh venv with
`--no-deps --no-index`, lends that venv this environment's site-packages through a `.pth`
file (torch, typer, ... are not downloaded), and runs the `actscan` script from a folder
outside the repository.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
# What `pip wheel` needs from the source tree; copying it keeps build/ and *.egg-info out
# of the checkout and keeps a stale build/lib from leaking deleted modules into the wheel.
SOURCES = ("pyproject.toml", "README.md", "actscan", "configs")
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["NO_COLOR"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _setuptools_is_enough() -> bool:
    """Whether this environment's setuptools meets pyproject's build requirement, so the
    wheel can be built without an isolated build environment (no index needed at all)."""
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    req = next(Requirement(r) for r in requires if Requirement(r).name == "setuptools")
    try:
        have = Version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(have, prereleases=True)


def _package_files(src: Path) -> set[str]:
    """Every file the package needs at run time, as its path inside the wheel."""
    names = {
        p.relative_to(src).as_posix()
        for p in (src / "actscan").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    names |= {
        f"actscan/configs/{p.name}"
        for p in (src / "configs").iterdir()
        if p.suffix in CONFIG_SUFFIXES
    }
    return names


@pytest.mark.slow
def test_installed_wheel_finds_shipped_configs(tmp_path: Path) -> None:
    env = _clean_env()
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(REPO / name, src / name)

    # 1. Build. Without isolation when setuptools is recent enough; otherwise pip makes an
    # isolated build environment from the indexes it is configured with.
    wheels = tmp_path / "wheels"
    isolation = ["--no-build-isolation"] if _setuptools_is_enough() else []
    build = ["-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(wheels), "."]
    _run([sys.executable, *build], cwd=src, env=env)
    (wheel,) = wheels.glob("actscan-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.startswith("actscan/")}
    missing = _package_files(src) - in_wheel
    assert not missing, f"files the package needs are not in the wheel: {sorted(missing)}"
    assert "actscan/report.schema.json" in in_wheel

    # 2. A fresh venv, without pip; this environment's pip installs into it, offline.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    install = ["-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    _run([sys.executable, *install, str(wheel)], cwd=tmp_path, env=env)

    # 3. Lend it this environment's site-packages (after its own, so the wheel wins). A .pth
    # line only adds the folder: this environment's own .pth files (an editable actscan)
    # are not run there.
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
        env=env,
    ).strip()
    lent = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    assert lent, sys.path
    (Path(purelib) / "_actscan_test_deps.pth").write_text("\n".join(lent) + "\n")

    # 4. Run from a folder outside the repository. The profile run is the long pole: it runs
    # while the other two checks do.
    work = tmp_path / "work"
    work.mkdir()
    actscan_script = bindir / ("actscan.exe" if os.name == "nt" else "actscan")
    profile_cmd = [str(actscan_script), "profile", "gpt-12-preln", "-q"]
    profile = subprocess.Popen(
        profile_cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        where = _run(
            [
                str(python),
                "-c",
                "import actscan, actscan.targets.classify as r, actscan.report.schema as s; "
                "print(actscan.__file__); print(r.CONFIGS_DIR); print(s.load_schema()['title'])",
            ],
            cwd=work,
            env=env,
        ).splitlines()
        listing = _run([str(actscan_script), "configs"], cwd=work, env=env)
        out, err = profile.communicate(timeout=300)
    finally:
        if profile.poll() is None:
            profile.kill()
            profile.communicate()

    package_file, configs_dir = Path(where[0]).resolve(), Path(where[1]).resolve()
    assert package_file.is_relative_to(venv.resolve()), package_file
    assert not package_file.is_relative_to(REPO), package_file
    assert configs_dir == package_file.parent / "configs", configs_dir
    assert where[2], "the installed report schema has no title"

    shipped = sorted(p.stem for p in (REPO / "configs").iterdir() if p.suffix in CONFIG_SUFFIXES)
    assert shipped
    listed = re.findall(r"^│ (\S+)\s", listing, flags=re.MULTILINE)
    assert sorted(listed) == shipped, listing

    assert profile.returncode == 0, f"{' '.join(profile_cmd)} exited {profile.returncode}\n{err}"
    assert "Findings" in out, out


def test_every_top_level_config_is_shipped_by_name() -> None:
    """From a checkout (editable install, or pytest in the repository) the lookup falls back
    to the top-level configs/ folder, which stays where users browse it; every file there is
    usable by name."""
    from actscan.targets.classify import shipped_configs

    shipped = shipped_configs()
    on_disk = {p.stem for p in (REPO / "configs").iterdir() if p.suffix in CONFIG_SUFFIXES}
    assert set(shipped) == on_disk
    assert all(path.is_file() for path in shipped.values())
