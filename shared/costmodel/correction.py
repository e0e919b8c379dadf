"""Online correction of predictions: an EWMA of measured/predicted per (device, operator or segment kind).

The simulator service feeds it pairs of (predicted, measured) seconds from worker events; the factor multiplies
later predictions, and the current error (EWMA of |measured − predicted·factor| / measured, i.e. what the
corrected model still misses) is exported as a metric.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CorrectionEntry:
    """State of one (device, kind) key."""

    factor: float = 1.0
    error: float = 0.0  # EWMA of the absolute relative error of corrected predictions
    raw_error: float = 0.0  # EWMA of the absolute relative error of uncorrected predictions
    samples: int = 0


class CorrectionTable:
    """Per-(device, kind) multiplicative correction factors learned as an EWMA of measured/predicted.

    ``alpha`` is the EWMA weight of a new sample; factors are clamped to ``[min_factor, max_factor]`` so one
    outlier cannot wreck the model. Keys are free-form strings: a device id or kind, and an operator or segment
    kind (``mlp``, ``attn``, ``qkv_proj`` …).
    """

    def __init__(self, alpha: float = 0.1, min_factor: float = 0.2, max_factor: float = 5.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha, self.min_factor, self.max_factor = alpha, min_factor, max_factor
        self._entries: dict[tuple[str, str], CorrectionEntry] = {}

    def observe(self, device: str, kind: str, predicted_s: float, measured_s: float) -> float:
        """Record one execution; returns the updated factor. Non-positive inputs are ignored."""
        if predicted_s <= 0 or measured_s <= 0:
            return self.factor(device, kind)
        e = self._entries.setdefault((device, kind), CorrectionEntry())
        a = 1.0 if e.samples == 0 else self.alpha
        err = abs(measured_s - predicted_s * e.factor) / measured_s
        raw = abs(measured_s - predicted_s) / measured_s
        e.error = err if e.samples == 0 else (1 - a) * e.error + a * err
        e.raw_error = raw if e.samples == 0 else (1 - a) * e.raw_error + a * raw
        ratio = measured_s / predicted_s
        e.factor = min(self.max_factor, max(self.min_factor, (1 - a) * e.factor + a * ratio))
        e.samples += 1
        return e.factor

    def factor(self, device: str, kind: str) -> float:
        """Current factor for (device, kind); 1.0 if never observed."""
        e = self._entries.get((device, kind))
        return e.factor if e else 1.0

    def correct(self, device: str, kind: str, predicted_s: float) -> float:
        """A prediction multiplied by its factor."""
        return predicted_s * self.factor(device, kind)

    def error(self, device: str | None = None, kind: str | None = None) -> float:
        """Mean current error (fraction) over the keys matching ``device``/``kind`` (None = all); 0 if none."""
        errs = [e.error for (d, k), e in self._entries.items()
                if (device is None or d == device) and (kind is None or k == kind)]
        return sum(errs) / len(errs) if errs else 0.0

    def factors_for(self, device: str) -> dict[str, float]:
        """All factors of one device, by kind (e.g. to build a corrected ModelCost)."""
        return {k: e.factor for (d, k), e in self._entries.items() if d == device}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Plain-data view ``{"device/kind": {factor, error, raw_error, samples}}`` for metrics and Redis."""
        return {f"{d}/{k}": {"factor": e.factor, "error": e.error, "raw_error": e.raw_error, "samples": e.samples}
                for (d, k), e in sorted(self._entries.items())}
