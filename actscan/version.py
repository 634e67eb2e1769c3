"""actscan's version, in a module of its own so that the package's modules can name it
without importing the package facade (`actscan/__init__.py` re-exports it).

Kept equal to `[project] version` in pyproject.toml.
"""

__version__ = "0.1.0"
