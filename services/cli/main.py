"""``slicesched`` command: one subcommand per module, imported lazily so each stays cheap to start.

The ``bench`` subcommands live in the :mod:`bench` package (evaluation, apart from the product) and are named here
only as module strings. A subcommand module defines ``configure(parser)`` and ``run(args) -> int``. Configuration
problems (:class:`shared.config.ConfigError`) and bad arguments print one line naming the file/field and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from shared.config import ConfigError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.cli.up", "start Redis (embedded default) and every service; Ctrl-C stops all"),
    "check-config": ("services.cli.check_config", "validate the configs and settings as `up` does, start nothing"),
    "simulate": ("services.cli.simulate", "replay a workload on a modelled cluster with one policy (offline)"),
    "plan": ("services.cli.plan", "plan each tenant's containers for a workload under the SLA (simulated)"),
    "profile": ("services.cli.profile", "micro-benchmark the real operators on a local device, write a profile"),
    "inspect": ("services.cli.inspect", "show devices, tenants, leases, forecasts, streams, a request's journey"),
}
BENCH: dict[str, tuple[str, str]] = {
    "overhead": ("bench.bench_overhead", "per-token time through the mesh vs in-process decode"),
    "cpu": ("bench.bench_cpu", "CPU per request of each mesh process at a steady load"),
    "accuracy": ("bench.bench_accuracy", "simulator error against the real CPU mesh"),
    "compare": ("bench.bench_compare", "max sustainable throughput per policy, side by side"),
    "anatomy": ("bench.bench_anatomy", "violations by cause and the idle capacity during them, at slice's boundary"),
    "decisions": ("bench.bench_decisions", "scheduling decision latency against Redis"),
    "transport": ("bench.bench_transport", "tensor transport bandwidth/latency per backend"),
    "whatif": ("bench.bench_whatif", "what-if RPC latency on a synthetic twin"),
    "guest": ("bench.bench_guest", "guest execution: segment RPC cost, step time alone vs leased"),
    "simspeed": ("bench.bench_simspeed", "simulator speed: events/s on a trace"),
    "results": ("bench.bench_results", "regenerate docs/results.md and the README headline"),
    "overload": ("bench.bench_overload", "goodput, rejects, accepted p99 and memory at 1x/2x/5x capacity"),
    "costmodel": ("bench.bench_costmodel", "GPU cost model vs measured H100/A100 timings (Vidur); --fit-out"),
    "models": ("bench.bench_models", "tokens/s of the engine vs transformers on the same model, batch 1 and 8"),
    "steering": ("bench.bench_steering", "a policy on a mesh with and without the simulator's steering, paired"),
    "scale": ("bench.bench_scale", "decision/what-if latency and simulator speed from 32 to 1,024 devices"),
    "tune": ("bench.bench_tune", "tune a policy's parameters on arrival seeds that are never reported"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 with one line, no usage dump noise
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str, load: bool = True) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module, _parser=p)
    if not load:  # only the chosen subcommand's module is imported (they can be heavy: torch, matplotlib)
        return
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=True)
        return
    mod.configure(p)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the subcommand it names has its module imported and its options added."""
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    cmd = words[0] if words else None
    bcmd = words[1] if cmd == "bench" and len(words) > 1 else None
    parser = _Parser(prog="slicesched", description="SliceScheduler: operator-level slice scheduling for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_, load=name == cmd)
    bench = sub.add_parser("bench", help="benchmarks (results go in docs/)")
    bsub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, (module, help_) in BENCH.items():
        _add(bsub, name, module, help_, load=name == bcmd)
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM (a CI timeout, ``kill``) unwinds like Ctrl-C: ``finally`` blocks run, so a bench stops the private
    redis-server and mesh it started instead of leaving them behind. A second SIGTERM during that clean-up is
    ignored. ``slicesched up`` installs its own handler (it drains the mesh)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"slicesched: this subcommand is not available in this build ({args._module})", file=sys.stderr)
        return 2
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except ConfigError as e:
        print(f"slicesched: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
