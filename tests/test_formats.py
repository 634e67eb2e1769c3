"""Report schema, Markdown, JUnit and atomic writes, on hand-made Reports (no model runs)."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import xml.etree.ElementTree as ET

import pytest
from helpers import make_report

from actscan.errors import UsageError
from actscan.numfmt import num
from actscan.records import CHECK_ORDER, CheckId, Finding, ModelInfo, RunInfo, Severity, Summary
from actscan.render.formats import to_junit, to_markdown
from actscan.report import output
from actscan.report.codec import to_json_obj
from actscan.report.output import write_atomic
from actscan.report.report import Report
from actscan.report.schema import load_schema, validate_report

jsonschema = pytest.importorskip("jsonschema")


# -- schema -----------------------------------------------------------------------------
def test_schema_is_valid_draft_2020_12():
    schema = load_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    jsonschema.Draft202012Validator.check_schema(schema)


def test_report_validates_also_after_json_round_trip():
    data = make_report().to_dict()
    validate_report(data)
    validate_report(json.loads(make_report().to_json()))


def test_empty_report_validates():
    report = Report(
        model=ModelInfo(source="m:f", family="custom", n_params=0),
        run=RunInfo(),
        layers=(),
        stream=(),
    )
    validate_report(report.to_dict())


def test_nonfinite_strings_validate():
    data = json.loads(make_report(nonfinite=True).to_json())
    mlp = data["layers"][2]
    assert (mlp["mean"], mlp["rms"], data["stream"][2]["rms"]) == ("nan", "inf", "inf")
    validate_report(data)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("stream"),
        lambda d: d["findings"][0].__setitem__("severity", "fatal"),
        lambda d: d.__setitem__("schema_version", 2),
        lambda d: d["layers"][0].__setitem__("rms", "NaN"),
        lambda d: d["layers"][0].__setitem__("rms", -1.0),
        lambda d: d["layers"][0].__setitem__("role", "branch"),
        lambda d: d["layers"][0].pop("grad_rms"),
        lambda d: d["run"].__setitem__("amp", "fp8"),
        lambda d: d["stream"][0].__setitem__("k", "0"),
    ],
    ids=[
        "missing-stream",
        "severity-fatal",
        "schema-version",
        "bad-nan-spelling",
        "negative-rms",
        "bad-role",
        "missing-layer-field",
        "bad-amp",
        "k-string",
    ],
)
def test_invalid_reports_fail(mutate):
    data = copy.deepcopy(make_report().to_dict())
    mutate(data)
    with pytest.raises(jsonschema.ValidationError):
        validate_report(data)


def test_extra_fields_allowed():
    data = make_report().to_dict()
    data["layers"][0]["new_stat"] = 1.0
    data["model"]["revision"] = "abc"
    data["run"]["compile"] = False
    data["stream"][0]["new_stat"] = "inf"
    validate_report(data)


def test_schema_ships_as_package_data():
    import importlib.resources

    assert importlib.resources.files("actscan").joinpath("report.schema.json").is_file()


# -- markdown ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("x", "s"),
    [
        (1.234, "1.23"),
        (0.012345, "0.0123"),
        (123456.0, "1.23e+05"),
        (120000.0, "1.20e+05"),
        (120000, "1.20e+05"),
        (0.0005, "5.00e-04"),
        (0.0, "0"),
        (None, "—"),
        (float("nan"), "nan"),
        (float("-inf"), "-inf"),
        ("inf", "inf"),
        (3, "3"),
    ],
)
def test_one_number_format(x, s):
    assert num(x) == s


def test_markdown_golden(golden):
    text = to_markdown(make_report(), fail_on="error")
    assert "| 4 | 1 | `h.1` | 1.23e+05 | — |" in text
    golden("report.md", text)


def test_markdown_worst_first_and_gate():
    report = make_report()
    text = to_markdown(report, fail_on="never")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "|" in line[2:]]
    severities = [r.split("|")[1].strip() for r in rows[2:6]]
    assert severities == ["error", "warn", "info", "info"]
    assert "**PASS**" in text
    assert "**FAIL**" in to_markdown(report, fail_on="warn")
    assert "… (+2)" in text  # 5 layers: first 3 shown
    assert "\\|" in text  # a pipe inside a message is escaped


def test_markdown_no_findings():
    report = Report(
        model=ModelInfo(source="m:f", family="custom", n_params=950),
        run=RunInfo(dtype="fp32", amp="bf16"),
        layers=(),
        stream=(),
    )
    text = to_markdown(report)
    assert "No findings." in text
    assert (
        text.splitlines()[0] == "### actscan: `m:f` (custom, 950 params, 0 blocks, fp32, amp bf16, "
        "train mode, dropout off)"
    )
    assert "**PASS**" in text


def test_markdown_from_json_round_trip_with_nonfinite():
    report = Report.from_dict(json.loads(make_report(nonfinite=True).to_json()))
    assert "| 4 | 1 | `h.1` | inf | — |" in to_markdown(report)


# -- junit ------------------------------------------------------------------------------
def _cases(root: ET.Element, suite: int = 0) -> dict[str, ET.Element]:
    return {c.get("name"): c for c in root.findall("testsuite")[suite].findall("testcase")}


@pytest.mark.parametrize(("fail_on", "failures"), [("error", 1), ("warn", 2), ("info", 3)])
def test_junit_counts(fail_on, failures):
    reports = [make_report("a.json"), make_report("b.json")]
    root = ET.fromstring(to_junit(reports, fail_on=fail_on))
    n = len(CheckId)
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures")) == (str(2 * n), str(2 * failures))
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["a.json", "b.json"]
    for suite in suites:
        cases = suite.findall("testcase")
        assert len(cases) == n == int(suite.get("tests"))
        assert sum(c.find("failure") is not None for c in cases) == failures
        assert int(suite.get("failures")) == failures
        assert {c.get("classname") for c in cases} == {f"actscan.{suite.get('name')}"}
        assert {c.get("name") for c in cases} == {c.value for c in CheckId}


def test_junit_failure_and_system_out():
    root = ET.fromstring(to_junit([make_report()], fail_on="warn"))
    cases = _cases(root)
    outlier = cases["outlier-channels"]
    assert outlier.find("failure").get("message") == "2 channels dwarf the median | max/median 24"
    assert "1 channel above 6" in outlier.find("system-out").text  # info: below the gate
    assert cases["sqrt-growth"].find("failure") is None
    assert "k^0.52" in cases["sqrt-growth"].find("system-out").text
    assert cases["exp-growth"].find("failure").get("type") == "error"
    assert list(cases["collapse"]) == []  # no finding: passes, no children


def test_junit_never_and_unknown_check():
    report = make_report()
    extra = Finding("new-check", Severity.ERROR, (), None, None, "bad\x00char")
    report = Report(report.model, report.run, report.layers, report.stream, (extra,))
    root = ET.fromstring(to_junit([report], fail_on="error"))
    assert root.get("tests") == str(len(CheckId) + 1)
    assert _cases(root)["new-check"].find("failure") is not None
    root = ET.fromstring(to_junit([report], fail_on="never"))
    assert root.get("failures") == "0"


def test_junit_cases_follow_the_one_check_order():
    report = make_report()
    extra = Finding("new-check", Severity.WARN, (), None, None, "x")
    report = Report(report.model, report.run, report.layers, report.stream, (extra,))
    names = [c.get("name") for c in ET.fromstring(to_junit([report])).iter("testcase")]
    assert names == [c.value for c in CHECK_ORDER] + ["new-check"]


def test_markdown_lists_equal_severities_in_check_order():
    f = lambda check: Finding(check, Severity.WARN, (), None, None, check)  # noqa: E731
    report = make_report()
    report = Report(report.model, report.run, (), (), (f("init-scale"), f("overflow")))
    text = to_markdown(report)
    assert text.index("| overflow |") < text.index("| init-scale |")


# -- JSON: one encoder, typed summary ----------------------------------------------------
def test_one_json_encoder():
    nan, inf = float("nan"), float("inf")
    data = {"a": (1.0, nan, -inf), "b": [{"c": inf}], "d": None, "e": "nan", "f": 3}
    assert output.json_safe(data) == {
        "a": [1.0, "nan", "-inf"],
        "b": [{"c": "inf"}],
        "d": None,
        "e": "nan",
        "f": 3,
    }
    assert to_json_obj(data) == output.json_safe(data)  # the codec spells them the same
    assert json.loads(output.dumps({"x": nan}, indent=None)) == {"x": "nan"}


def test_summary_is_typed_and_its_json_unchanged():
    report = make_report(nonfinite=True)
    s = report.summary
    assert isinstance(s, Summary) and s.growth == 120000.0 and s["gain_per_block"] == 1.07
    assert s.get("no-such-key") is None and "growth" in s
    data = json.loads(report.to_json())
    assert list(data["summary"]) == [
        "growth_exponent",
        "gain_per_block",
        "growth",
        "var_intercept",
        "var_slope",
        "grad_ratio",
    ]
    assert data["summary"] == {
        "growth_exponent": 0.52,
        "gain_per_block": 1.07,
        "growth": 120000.0,
        "var_intercept": None,
        "var_slope": 0.0005,
        "grad_ratio": "nan",
    }
    back = Report.from_dict(data)
    assert isinstance(back.summary, Summary) and back.summary.grad_ratio is not None
    assert math.isnan(back.summary.grad_ratio)  # "nan" is read back as the float
    assert dict(back.summary) == {**data["summary"], "grad_ratio": back.summary.grad_ratio}
    assert back.to_json() == report.to_json()  # byte for byte after a round trip


def test_summary_accepts_the_plain_dict_it_replaces():
    report = make_report()
    legacy = Report(report.model, report.run, (), (), summary={"growth": 2.0, "extra": 1})
    assert isinstance(legacy.summary, Summary)
    assert legacy.summary.growth == 2.0 and legacy.summary.growth_exponent is None
    assert legacy.to_dict()["summary"]["growth"] == 2.0


# -- write_atomic -----------------------------------------------------------------------
def test_write_atomic_replaces(tmp_path):
    target = tmp_path / "out.md"
    target.write_text("old")
    write_atomic(target, "new ✓\n")
    assert target.read_text(encoding="utf-8") == "new ✓\n"
    assert os.listdir(tmp_path) == ["out.md"]


def test_write_atomic_stdout(capsys):
    write_atomic("-", "hello\n")
    assert capsys.readouterr().out == "hello\n"


def test_write_atomic_missing_folder(tmp_path):
    with pytest.raises(UsageError, match=r"cannot write .*nope.*out\.json"):
        write_atomic(tmp_path / "nope" / "out.json", "{}")


def test_write_atomic_directory_target_leaves_no_temp(tmp_path):
    target = tmp_path / "adir"
    target.mkdir()
    with pytest.raises(UsageError, match="cannot write"):
        write_atomic(target, "x")
    assert os.listdir(tmp_path) == ["adir"]
    assert os.listdir(target) == []


def test_write_atomic_failure_mid_write_leaves_no_temp(tmp_path, monkeypatch):
    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    target = tmp_path / "out.xml"
    with pytest.raises(UsageError, match="No space left on device"):
        write_atomic(target, "x")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(
    sys.platform == "win32" or (hasattr(os, "geteuid") and os.geteuid() == 0),
    reason="needs POSIX permissions and a non-root user",
)
def test_write_atomic_unwritable_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="cannot write"):
            write_atomic(folder / "out.json", "{}")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o700)


def test_write_atomic_parent_is_a_file(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="cannot write"):
        write_atomic(blocker / "out.json", "{}")
    assert os.listdir(tmp_path) == ["file.txt"]


def test_write_atomic_bytes_and_keeps_mode(tmp_path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    target.chmod(0o640)
    write_atomic(target, b"\x89PNG\r\n")
    assert target.read_bytes() == b"\x89PNG\r\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["plot.png"]


def test_plot_writes_through_the_one_writer(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from actscan.render import plot

    seen = []
    monkeypatch.setattr(plot, "write_atomic", lambda path, data: seen.append((path, data)))
    plot.plot_streams([plot.Series("x", (0, 1), (1.0, 2.0))], tmp_path / "x.svg")
    assert seen and seen[0][0] == tmp_path / "x.svg" and b"<svg" in seen[0][1]
    assert os.listdir(tmp_path) == []


def test_no_torch_import():
    import subprocess

    code = (
        "import sys, actscan.render.formats, actscan.report.schema, actscan.settings; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
