"""argparse ``type=`` checks shared by the ``slicesched`` and ``loadgen`` commands.

A bad value becomes argparse's one-line usage error naming the option (``argument --tolerance: must be positive,
got 0``) and exit status 2, instead of a traceback, a hang (a bisection that never narrows) or a silent zero.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable
from urllib.parse import urlsplit


def _number(kind: type, test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if (kind is float and not math.isfinite(v)) or not test(v):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    parse.__name__ = f"{kind.__name__} ({what})"
    return parse


positive_float = _number(float, lambda v: v > 0, "positive")
nonneg_float = _number(float, lambda v: v >= 0, ">= 0")
positive_int = _number(int, lambda v: v > 0, "positive")
nonneg_int = _number(int, lambda v: v >= 0, ">= 0")
fraction = _number(float, lambda v: 0 <= v <= 1, "between 0 and 1")


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host (the gateway's address)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL with a host, got {text!r}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None
    return text.rstrip("/")


def seed_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of distinct seeds (integers ≥ 0), e.g. ``1,2,3``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a comma-separated list of seeds, e.g. 1,2,3")
    out = tuple(nonneg_int(p) for p in parts)
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"seeds repeat: {text}")
    return out


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of distinct names, e.g. ``container,slice``."""
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names, e.g. container,slice")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"names repeat: {text}")
    return out


def name_seconds(text: str) -> dict[str, float]:
    """A comma-separated list of ``NAME=SECONDS`` (distinct names, seconds ≥ 0), e.g. ``container=0.04,slice=0.06``."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=SECONDS, got {part!r}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"names repeat: {text}")
        out[name.strip()] = nonneg_float(value.strip())
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list of NAME=SECONDS, e.g. container=0.04")
    return out
