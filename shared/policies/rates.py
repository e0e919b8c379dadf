"""A tenant's recent arrival rate and mean request lengths, measured the same way by the offline simulator and the
live scheduler (what :class:`~shared.policies.snapshot.TenantState` carries to the policies).

The rate counts arrivals in a sliding window (``window_s``, 30 s) over the window's length, or over the time since
``start`` while that is shorter (at least 1 s). An EWMA of inverse inter-arrival gaps was tried on the live side:
inside a burst its gaps are milliseconds, so it read tens to hundreds of requests per second, and the what-if
then predicted every guest lane's memory to overflow (``memory_window``) and refused them all.
"""
from __future__ import annotations

from collections import deque

RATE_WINDOW_S = 30.0
LENGTH_EWMA = 0.05


class ArrivalStats:
    """Sliding-window arrival rate and EWMA prompt/output lengths of one tenant."""

    __slots__ = ("start", "window_s", "_times", "rate_rps", "mean_input", "mean_output")

    def __init__(self, start: float = 0.0, window_s: float = RATE_WINDOW_S) -> None:
        self.start, self.window_s = start, window_s
        self._times: deque[float] = deque()
        self.rate_rps = self.mean_input = self.mean_output = 0.0

    def observe(self, now: float, prompt_tokens: float, output_tokens: float) -> None:
        """One arrival at ``now`` with these lengths (``output_tokens``: the expected or maximum output)."""
        self._times.append(now)
        self.rate_rps = self.rate(now)
        if self.mean_input == 0.0:
            self.mean_input, self.mean_output = float(prompt_tokens), float(output_tokens)
        else:
            self.mean_input += LENGTH_EWMA * (prompt_tokens - self.mean_input)
            self.mean_output += LENGTH_EWMA * (output_tokens - self.mean_output)

    def rate(self, now: float) -> float:
        """The rate as of ``now`` (arrivals that have left the window no longer count)."""
        win = self._times
        while win and win[0] < now - self.window_s:
            win.popleft()
        return len(win) / max(1.0, min(self.window_s, now - self.start))
