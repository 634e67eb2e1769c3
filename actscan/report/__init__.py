"""The report as data: the `Report` type (`report`), its JSON Schema (`schema`), the one
JSON codec of the records (`codec`) and the one JSON encoder and atomic writer (`output`).
Nothing here measures, judges or renders."""
