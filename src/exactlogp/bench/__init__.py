"""Benchmarks of exactlogp against the pipelines it replaces (`exactlogp bench`)."""
