"""``loadgen`` command: ``workload build``, ``workload show`` and ``replay``.

Bad files or arguments print one line naming the file and field and exit 2; Ctrl-C during a replay still
writes the records and a summary marked partial.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from shared.argtypes import http_url, nonneg_float, nonneg_int, positive_float, positive_int
from shared.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _alpha(text: str) -> float | None:
    if text == "native":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'native', got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("alpha must be ≥ 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loadgen", description="SliceScheduler load generator: workloads from traces, open-loop replay")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    wl = sub.add_parser("workload", help="build or inspect workload files")
    wsub = wl.add_subparsers(dest="workload_command", required=True, parser_class=_Parser)

    b = wsub.add_parser("build", help="write a workload file from traces and a tenants file")
    b.add_argument("--trace", action="append", required=True, help="trace file (repeat; tenants take them in turn)")
    b.add_argument("--format", action="append", choices=("azure", "jsonl", "csv", "servegen"),
                   help="trace format (once for all traces, or once per --trace); default: guessed")
    b.add_argument("--columns", action="append",
                   help="csv column mapping, e.g. time=ts_s,input=prompt,output=completion")
    b.add_argument("--time-unit", default="s", choices=("s", "ms", "us", "ns", "iso"), help="csv time column unit")
    b.add_argument("--tenants", required=True, help="tenants file (tenants in popularity order)")
    b.add_argument("--cluster", help="cluster file to record in the workload (optional)")
    b.add_argument("--alpha", type=_alpha, required=True, help="power-law popularity exponent, or 'native'")
    b.add_argument("--seed", type=nonneg_int, required=True)
    b.add_argument("--duration-s", type=positive_float, required=True)
    b.add_argument("--rate-scale", type=positive_float, default=1.0)
    b.add_argument("--base-rate-rps", type=positive_float, help="total base rate (default: sum of the traces' rates)")
    b.add_argument("--max-input-tokens", type=positive_int, help="global prompt cap (the model context always applies)")
    b.add_argument("--max-output-tokens", type=positive_int, help="global output cap")
    b.add_argument("--servegen-model", default="m-large", help="servegen: model (m-large, m-mid, m-small, …)")
    b.add_argument("--servegen-clients", type=positive_int, default=16, help="servegen: top-N clients by rate in the span")
    b.add_argument("--servegen-start-s", type=nonneg_float, default=0.0, help="servegen: span start in the 14 days")
    b.add_argument("--servegen-span-s", type=positive_float, help="servegen: span length (default: duration)")
    b.add_argument("--name", help="workload name (default: output file name)")
    b.add_argument("-o", "--output", required=True, help="workload file to write")

    s = wsub.add_parser("show", help="summarise a workload file")
    s.add_argument("workload")
    s.add_argument("--rate-scale", type=positive_float)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")

    r = sub.add_parser("replay", help="open-loop replay of a workload against the gateway")
    r.add_argument("--workload", required=True)
    r.add_argument("--url", type=http_url, default="http://127.0.0.1:8000")
    keys = r.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", help="YAML mapping tenant → API key")
    keys.add_argument("--tenants", help="tenants file with plain-text api_keys (dev)")
    r.add_argument("--rate-scale", type=positive_float)
    r.add_argument("--duration-s", type=positive_float, help="send only arrivals before this time")
    r.add_argument("--max-requests", type=positive_int)
    r.add_argument("--timeout-s", type=positive_float, default=300.0, help="per-request limit")
    r.add_argument("--grace-s", type=nonneg_float, default=5.0, help="wait for in-flight requests after Ctrl-C")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--out", required=True, help="output folder")
    return p


def _traces(args: argparse.Namespace):
    from loadgen.builder import TraceChoice
    from loadgen.traces import parse_columns

    n = len(args.trace)

    def per(values: list | None, what: str) -> list:
        if not values:
            return [None] * n
        if len(values) == 1:
            return values * n
        if len(values) != n:
            raise ConfigError("(arguments)", what, f"give it once or once per --trace ({n}), got {len(values)}")
        return values

    fmts, cols = per(args.format, "--format"), per(args.columns, "--columns")
    return [TraceChoice(path=t, format=f, columns=parse_columns(c) if c else None, time_unit=args.time_unit,
                        servegen_model=args.servegen_model, servegen_clients=args.servegen_clients,
                        servegen_start_s=args.servegen_start_s, servegen_span_s=args.servegen_span_s)
            for t, f, c in zip(args.trace, fmts, cols)]


def cmd_build(args: argparse.Namespace) -> int:
    from loadgen.builder import workload_document, write_workload_file
    from loadgen.builder import format_stats, workload_stats
    from loadgen.workload import load_workload, parse_workload

    out = Path(args.output)
    doc = workload_document(out, _traces(args), args.tenants, args.alpha, args.seed, args.duration_s,
                            args.rate_scale, args.cluster, args.base_rate_rps, args.max_input_tokens,
                            args.max_output_tokens, args.name)
    parse_workload(doc, out)  # validate before writing anything
    write_workload_file(out, doc)
    t = time.perf_counter()
    w = load_workload(out)
    print(format_stats(workload_stats(w)))
    print(f"wrote {out} ({len(w.requests)} requests, mean rate {len(w.requests) / w.duration_s:.3f} req/s; "
          f"built in {time.perf_counter() - t:.2f} s)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from loadgen.builder import format_stats, workload_stats
    from loadgen.workload import load_workload

    t = time.perf_counter()
    w = load_workload(args.workload, rate_scale=args.rate_scale)
    st = workload_stats(w)
    st["load_s"] = time.perf_counter() - t
    print(json.dumps(st, indent=2) if args.json else format_stats(st) + f"\n(loaded in {st['load_s']:.2f} s)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from loadgen.report import summary_markdown
    from loadgen.runner import run_replay

    if args.max_requests is not None and args.max_requests <= 0:
        raise ConfigError("(arguments)", "--max-requests", "must be positive")
    summary = run_replay(args.workload, args.url, args.out, api_key_file=args.api_key_file, tenants_file=args.tenants,
                         rate_scale=args.rate_scale, duration_s=args.duration_s, max_requests=args.max_requests,
                         timeout_s=args.timeout_s, grace_s=args.grace_s, progress=not args.no_progress)
    print(summary_markdown(summary), end="")
    return 130 if summary["partial"] else 0


def _setup_logging() -> None:
    import structlog

    structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper("iso"),
                                    structlog.dev.ConsoleRenderer(colors=False)],
                        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))  # sys.stderr looked up per use


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``loadgen`` console script."""
    args = build_parser().parse_args(argv)
    _setup_logging()
    handler = {"build": cmd_build, "show": cmd_show}.get(getattr(args, "workload_command", None), cmd_replay)
    try:
        return handler(args)
    except ConfigError as e:
        print(f"loadgen: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
