"""The report and everything that shows it: the `Report` type (`report`), its JSON Schema
(`schema`), CI formats (`formats`), rich tables (`render`, `render_compare`), plots (`plot`)
and the one number format (`numfmt`). Nothing here measures or judges."""
