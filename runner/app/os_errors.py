"""What the system refused (disk full, permissions), said in one line at the CLI's edge."""

from __future__ import annotations


def reason(e: OSError) -> str:
    """The system's words for `e` on one line (its strerror, else its text, else its type)."""
    return " ".join((e.strerror or str(e) or type(e).__name__).split())
