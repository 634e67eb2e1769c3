"""Showing reports: rich tables (`terminal`, `compare`, `steps`), CI formats (`formats`) and
plots (`plot`). Rendering formats numbers computed before they get here; it never measures."""
