"""Several reports: two side by side (`pairs`), their first steps (`steps`) and one report per
size (`sweep`)."""
