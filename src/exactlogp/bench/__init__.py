"""Benchmarks of exactlogp against the pipelines it replaces (`exactlogp bench`), on the
report's candidates, worlds and measurement (exactlogp.report)."""
