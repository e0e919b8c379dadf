"""Human output for ``slicesched inspect``: aligned plain-text tables and short units (bytes, ages, ratios)."""
from __future__ import annotations

from typing import Any, Sequence


def human_bytes(n: Any) -> str:
    """``12657664`` -> ``12.1MiB``; ``None`` -> ``-``."""
    if n is None or n == "":
        return "-"
    try:
        v = float(n)
    except (TypeError, ValueError):
        return str(n)
    sign = "-" if v < 0 else ""
    v = abs(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f}{unit}" if unit == "B" else f"{sign}{v:.1f}{unit}"
        v /= 1024
    return f"{sign}{v:.1f}TiB"


def human_age(seconds: Any) -> str:
    """Seconds as ``0.4s`` / ``12s`` / ``3m05s`` / ``2h01m``; ``None`` -> ``-``."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def human_ms(ms: Any) -> str:
    return "-" if ms is None else human_age(float(ms) / 1000.0)


def ratio(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{float(v):.{digits}f}"


def percent(v: Any) -> str:
    return "-" if v is None else f"{100.0 * float(v):.1f}%"


def _is_num(cell: str) -> bool:
    t = cell.rstrip("%smhBKiMGT").lstrip("-")
    return bool(t) and t.replace(".", "", 1).isdigit()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str = "") -> str:
    """Columns padded to their widest cell; numeric-looking cells right-aligned. ``empty`` shown when no rows."""
    cells = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for r in cells:
        lines.append("  ".join((c.rjust(widths[i]) if _is_num(c) else c.ljust(widths[i]))
                               for i, c in enumerate(r)).rstrip())
    if not cells and empty:
        lines.append(empty)
    return "\n".join(lines)


def key_values(pairs: Sequence[tuple[str, Any]]) -> str:
    """``key: value`` lines with the keys padded to one width."""
    if not pairs:
        return ""
    w = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(w)}  {'-' if v is None else v}" for k, v in pairs)
