"""The conformance report: exactlogp and its peers measured side by side on shared logits.

`exactlogp report` (exactlogp/cli.py) drives runner.run:

  candidates/   one module per candidate, registered by name, each saying what it runs
  workload.py   the shared seeded logits and their fp64 truth
  session.py    what one run knows as it goes
  worlds.py     spawned torch.distributed worlds, timeouts, clean-up
  torchrun.py   the same measurements inside a torchrun world
  job.py        the measurements inside a world
  emulation.py  collective settings: NCCL knobs, or emulated reduction orders on gloo
  checks.py     verdicts from raw measurements
  assemble.py   the report dictionary (header, entries, method)
  schema.py     its JSON schema
  display.py    progress, the final table, the Markdown summary
"""
