"""Human-readable byte counts, shared by graphzero-dump's views and graphzero-compare's report.

No imports: graphzero-dump must start without torch."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB plain bytes."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
