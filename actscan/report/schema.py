"""The JSON Schema of the report (`actscan/report.schema.json`) and a validator.

`jsonschema` is a development dependency only: `load_schema()` always works,
`validate_report()` needs it installed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "report.schema.json"


@lru_cache(maxsize=1)
def _schema_text() -> str:
    return resources.files("actscan").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def load_schema() -> dict[str, Any]:
    """The report schema (draft 2020-12) as a fresh dict (safe to modify)."""
    return json.loads(_schema_text())


def validate_report(data: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` (the most relevant error) if `data` — a report
    as `Report.to_dict()` or `json.loads(report_json)` gives it — breaks the schema.

    Raises ImportError when the optional `jsonschema` package is missing.
    """
    try:
        import jsonschema
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "validating an actscan report needs the 'jsonschema' package "
            "(a development dependency): pip install jsonschema"
        ) from err
    validator = jsonschema.Draft202012Validator(load_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        raise error
