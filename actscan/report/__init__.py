"""The report and everything that shows it: the `Report` type (`report`), its JSON Schema
(`schema`), CI formats (`formats`), rich tables (`render`, `render_compare`), plots (`plot`),
the one number format (`numfmt`) and the one JSON encoder and atomic writer (`output`).
Nothing here measures or judges."""
