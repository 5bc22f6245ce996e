"""The `exactlogp` command: `exactlogp report` (the conformance report) and
`exactlogp bench` (CPU benchmarks, in exactlogp.bench.cpu)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    from .report.candidates import split_names

    return split_names(text)


def build_parser() -> argparse.ArgumentParser:
    from .report.runner import DEFAULT_CANDIDATES, PRESETS, ReportOptions

    d = ReportOptions(command="")
    parser = argparse.ArgumentParser(prog="exactlogp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser(
        "report",
        help="measure exactlogp and its peers on shared logits; write JSON + Markdown",
        description="Defaults are the Qwen3-Next prior-art workload. Options given on the "
        "command line win over the preset's values.",
    )
    opt = rep.add_argument
    opt("--tokens", type=int, help=f"rows of logits (default {d.tokens})")
    opt("--vocab", type=int, help=f"vocabulary size (default {d.vocab})")
    opt(
        "--hidden-tokens",
        type=int,
        dest="hidden_tokens",
        help=f"rows of the hidden-state (fused LM-head) workload (default {d.hidden_tokens})",
    )
    opt(
        "--hidden-size",
        type=int,
        dest="hidden_size",
        help=f"H of the hidden-state workload; Qwen3-Next's is 2048 (default {d.hidden_size})",
    )
    opt(
        "--hidden-outlier",
        type=float,
        dest="hidden_outlier",
        help="two hidden-state channels this many times the rest, e.g. 100 (default: "
        "H // 64 channels 8x the rest)",
    )
    opt("--tp", type=_int_list, help=f"TP degrees, e.g. 1,4 (default {','.join(map(str, d.tp))})")
    opt("--repeats", type=int, help=f"timed runs, also the repeats compared (default {d.repeats})")
    opt("--dtype", choices=("bf16", "fp16", "fp32"), help=f"logits dtype (default {d.dtype})")
    opt(
        "--candidates",
        type=_names,
        help=f"comma-separated (default: {','.join(DEFAULT_CANDIDATES)})",
    )
    opt("--out", help=f"report JSON; the Markdown summary goes next to it (default {d.out})")
    opt("--preset", choices=sorted(PRESETS), help="quick: small workloads for CI (a few minutes)")
    opt("--device", choices=("auto", "cpu", "cuda"), help="default auto: CUDA if available")
    opt(
        "--check-rows",
        type=int,
        dest="check_rows",
        help=f"rows of the batch and setting checks (default {d.check_rows})",
    )
    opt(
        "--hidden-check-rows",
        type=int,
        dest="hidden_check_rows",
        help=f"check rows of the hidden-state workload (default {d.hidden_check_rows})",
    )
    opt(
        "--timeout",
        type=float,
        dest="timeout_s",
        help=f"seconds per world before it is killed (default {d.timeout_s:.0f})",
    )
    opt(
        "--threads-per-rank",
        type=int,
        dest="threads_per_rank",
        help=f"intra-op threads per rank (default {d.threads_per_rank})",
    )
    opt("--seed", type=int, help=f"workload seed (default {d.seed})")
    opt(
        "--processed-tokens",
        type=int,
        dest="processed_tokens",
        help="rows of the processed-logprobs (top-k / top-p / min-p) table; 0 leaves it out "
        f"(default {d.processed_tokens})",
    )
    bench = sub.add_parser("bench", help="CPU benchmarks (exactlogp.bench.cpu)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return _report(args, argv)


def _bench(argv: list[str]) -> int:
    try:
        from .bench.cpu import main as bench_main
    except ImportError as exc:
        print(
            f"exactlogp bench: the CPU benchmark module is not available ({exc})", file=sys.stderr
        )
        return 2
    return int(bench_main(argv) or 0)


def _report(args: argparse.Namespace, argv: list[str]) -> int:
    import shlex

    try:
        from rich.console import Console

        from .report import display, runner
    except ImportError as exc:
        print(
            f"exactlogp report needs the 'report' extra: pip install 'exactlogp[report]' ({exc})",
            file=sys.stderr,
        )
        return 2
    overrides = {
        k: v for k, v in vars(args).items() if k not in ("command", "preset") and v is not None
    }
    # a plain `kill` ends the report like Ctrl-C: worlds are stopped, temporary files go
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        opts = runner.make_options(
            args.preset, command=shlex.join(["exactlogp", *argv]), **overrides
        )
        err = Console(stderr=True)
        with display.RichDisplay(err) as shown:
            report, status = runner.run(opts, shown)
    except ValueError as exc:
        print(f"exactlogp report: {exc}", file=sys.stderr)
        return 2
    if report is None:  # a torchrun rank other than 0
        return status
    display.print_summary(Console(), report, _write(report, opts.out, err))
    if status:
        from .report.checks import exactlogp_failures

        for line in exactlogp_failures(report["candidates"]):
            err.print(f"[red]exactlogp failed: {line}")
    return status


def _write(report: dict, out: str, err) -> list[str]:
    """The JSON at `out`; next to it the fused LM-head plot (<stem>_fused.png, where the
    report has such rows and matplotlib imports) and the Markdown summary (<stem>.md)."""
    from .report.display import markdown

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    stem = os.path.splitext(out)[0]
    written, plot = [out], None
    try:
        from .report.plot import write_fused_plot

        if write_fused_plot(report, stem + "_fused.png"):
            written.append(plot := stem + "_fused.png")
    except ImportError as exc:  # matplotlib is in the report extra
        err.print(f"exactlogp report: no plot ({exc})")
    with open(stem + ".md", "w") as f:
        f.write(markdown(report, os.path.basename(plot) if plot else None))
    return [*written, stem + ".md"]


if __name__ == "__main__":
    sys.exit(main())
