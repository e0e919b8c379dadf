"""How steady this machine's speed is: one fixed computation timed over many short windows.

On a shared or virtual machine the same work takes a different time from one moment to the next (other tenants
of the host, frequency changes, cache and memory-bandwidth contention). A request's TTFT and TPOT sample that
speed over tens to hundreds of milliseconds, so no prediction from the work alone can beat it: the median
absolute deviation of the windows from their median is the median APE a perfect predictor of a fixed
computation would score on this machine, now. ``slicesched bench accuracy`` measures it before the mesh starts
and reports it beside the errors.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def matmul_chain(hidden: int = 256, depth: int = 40) -> Callable[[], None]:
    """A fixed single-threaded computation shaped like one decode step of a small model (``depth`` matrix-vector
    products of ``hidden`` wide)."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    x = torch.randn(1, hidden, generator=g)

    def work() -> None:
        y = x
        for _ in range(depth):
            y = torch.tanh(y @ w)
    return work


def window_stats(durations: list[float]) -> dict[str, float]:
    """Spread of equal-work window durations around their median: the median absolute relative deviation (a
    perfect constant predictor's median APE), the 10th/90th percentile and the extremes as ratios to the median,
    and the correlation of consecutive windows (how far the recent past tells the next window's speed)."""
    if len(durations) < 3:
        raise ValueError("need at least 3 windows")
    med = statistics.median(durations)
    seq = [d / med for d in durations]
    r = sorted(seq)
    n = len(r)
    try:
        lag1 = statistics.correlation(seq[:-1], seq[1:])
    except statistics.StatisticsError:  # constant durations
        lag1 = 0.0
    return {"windows": n, "median_s": med, "median_abs_dev": statistics.median(abs(x - 1) for x in r),
            "p10": r[int(0.1 * (n - 1))], "p90": r[int(0.9 * (n - 1))], "min": r[0], "max": r[-1],
            "lag1_autocorr": lag1}


def steadiness(duration_s: float = 5.0, window_s: float = 0.05, *, work: Callable[[], None] | None = None,
               clock: Callable[[], float] = time.perf_counter, threads: int = 1) -> dict[str, float]:
    """Time windows of the same number of ``work`` calls (sized to about ``window_s`` each) for about
    ``duration_s``; :func:`window_stats` of their durations, with the window length asked for."""
    if duration_s <= 0 or window_s <= 0 or window_s * 3 > duration_s * (1 + 1e-9):
        raise ValueError("duration_s must hold at least 3 windows of window_s > 0")
    restore = None
    if work is None:
        import torch

        restore = torch.get_num_threads()
        torch.set_num_threads(threads)
        work = matmul_chain()
    try:
        calls, t0 = 0, clock()
        while clock() - t0 < window_s:  # how many calls fill one window (also warms up)
            work()
            calls += 1
        durations: list[float] = []
        end = clock() + duration_s
        while clock() < end or len(durations) < 3:
            a = clock()
            for _ in range(calls):
                work()
            durations.append(clock() - a)
    finally:
        if restore is not None:
            import torch

            torch.set_num_threads(restore)
    return {"window_s": window_s, "calls_per_window": calls} | window_stats(durations)
