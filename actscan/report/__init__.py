"""The report as data: the `Report` type (`report`), its JSON Schema (`schema`), the steps
section's JSON (`steps_io`) and the one JSON encoder and atomic writer (`output`). Nothing
here measures, judges or renders."""
