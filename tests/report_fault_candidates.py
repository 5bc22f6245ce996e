"""Candidates that misbehave on purpose, for the report's robustness tests.

Not collected by pytest (no test_ prefix); the spawned ranks import it by name.
"""

import os
import time

import torch

from exactlogp.report.candidates.base import Candidate


class RaiseOnRank1(Candidate):
    name = "raise_on_rank1"
    summary = "raises RuntimeError in build on rank 1 only"

    def build(self, ctx):
        if ctx.rank == 1:
            raise RuntimeError("deliberate failure on rank 1")
        return lambda logits, target: torch.zeros(logits.shape[0])


class ExitOnRank1(Candidate):
    name = "exit_on_rank1"
    summary = "rank 1 ends its process with exit code 3 in the middle of a run"

    def build(self, ctx):
        def run(logits, target):
            if ctx.rank == 1:
                os._exit(3)
            torch.distributed.barrier(group=ctx.group)
            return torch.zeros(logits.shape[0])

        return run


class HangOnRank0(Candidate):
    name = "hang_on_rank0"
    summary = "rank 0 never returns from its first run"

    def build(self, ctx):
        def run(logits, target):
            if ctx.rank == 0:
                while True:
                    time.sleep(1)
            torch.distributed.barrier(group=ctx.group)
            return torch.zeros(logits.shape[0])

        return run
