"""How messages and reports show values: lists of names, byte counts.

listed(["a.weight", "b.weight"])   # '[a.weight, b.weight]', the first 8 of a long list
format_bytes(3 * 2**20)            # '3.0 MiB'
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_bytes", "listed"]


def listed(names: Sequence[str], limit: int = 8) -> str:
    """``names`` in brackets, the first ``limit`` of them."""
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def format_bytes(value: float) -> str:
    """'1.5 GiB', '320.0 MiB', '12 B'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # unreachable; keeps type checkers content
