"""Numbers and tables for people: bytes in B/MiB/GiB (2^20, 2^30), GitHub-markdown tables.

No import beyond the standard library: every command prints through it.
"""

GiB, MiB = 2 ** 30, 2 ** 20


def fmt_bytes(n):
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.3f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    return f"{sign}{n:,} B"


def fmt_pct(p):
    return "-" if p is None else f"{p:+.3f}%"


def table(header, rows):
    """A GitHub-markdown table from a header tuple and rows of strings."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
