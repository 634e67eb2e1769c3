"""Errors the user can act on. Each maps to one line on stderr and exit code 2."""

from __future__ import annotations


class ActscanError(Exception):
    """Base: a user mistake or a bad file. `str(err)` is the one line the user sees."""

    exit_code = 2


class UsageError(ActscanError):
    """Bad option values or combinations."""


class BadInputError(ActscanError):
    """A missing, corrupt, unsupported or inconsistent file or model."""


class ConfigError(BadInputError):
    """A config file that cannot be parsed or has unknown/invalid fields."""
