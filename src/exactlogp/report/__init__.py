"""The conformance report: exactlogp and its peers measured side by side on shared logits.

`exactlogp report` (cli.py) drives runner.run: candidates/ (one module per candidate),
job.py (the measurements inside a world), worlds.py (spawned or torchrun worlds),
emulation.py (collective settings), checks.py (verdicts), schema.py (the JSON schema),
display.py (progress, table, Markdown).
"""
