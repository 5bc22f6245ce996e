"""The conformance report, and the harness it shares with the bench and the GPU check.

`exactlogp report` (exactlogp/cli.py) drives runner.run:

  candidates/   one module per candidate, registered by name, each saying what it runs
                (the one registry of the report, `exactlogp bench` and exactlogp.gpucheck)
  worlds.py     every multi-process torch.distributed world, the free port, the timeout policy,
                the process group of one rank
  measure.py    interleaved timing in shuffled rounds, clocks, peak memory
  tp1.py        candidates at TP1 in this process (the bench and the GPU check)
  workload.py   the shared seeded workloads and their fp64 truth: logits; hidden states
                and an LM-head weight (the fused LM-head rows)
  session.py    what one run knows as it goes
  torchrun.py   the same measurements inside a torchrun world
  job.py        the measurements inside a world (checks, timing), crash and hang isolation
  emulation.py  collective settings: NCCL knobs, or emulated reduction orders on gloo
  checks.py     verdicts from raw measurements
  assemble.py   the report dictionary (header, entries, method)
  schema.py     its JSON schema
  display.py    progress, the final tables (one per workload), the Markdown summary
  plot.py       the fused LM-head rows' latency and error vs fp64, as a PNG
"""
