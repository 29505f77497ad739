"""A lost rank: the line every survivor prints (perseus_legacy/tf1/survivor.py), which
`perseusrun --restarts` reads (perseusrun/supervise.py)."""

from __future__ import annotations

import re

_LOST_RANK_LINE = re.compile(r"perseus_legacy\[rank (\d+)\]: rank (\d+) was lost")


def lost_rank_line(rank: int, lost: int, saved: str) -> str:
    """What survivor `rank` prints when rank `lost` is gone; `saved` says what was saved where."""
    return f"perseus_legacy[rank {rank}]: rank {lost} was lost; {saved}"


def lost_rank_in(line: str) -> int | None:
    """The rank a lost_rank_line() names, or None for any other line."""
    found = _LOST_RANK_LINE.search(line)
    return int(found.group(2)) if found else None


_SAVED = re.compile(r"(?:saved global step (\d+)|global step (\d+) was already saved): (\S+)")


def saved_step_in(line: str) -> tuple[int, str] | None:
    """(global step, checkpoint path) when a lost_rank_line() says that step is saved whole."""
    found = _SAVED.search(line) if _LOST_RANK_LINE.search(line) else None
    return (int(found.group(1) or found.group(2)), found.group(3)) if found else None
