"""Merges the timeline files of a job's ranks into one Chrome trace (one process row per rank).

Each rank writes its own file (perseus_legacy.start_timeline / PERSEUS_TIMELINE): events carry
"pid" = rank and wall-clock microseconds, so merging is concatenation.

Run: python -m perseus_legacy.timeline merge OUT IN [IN ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: str | Path) -> list:
    """The events of one rank's timeline file (a JSON array of trace events)."""
    with open(path) as f:
        events = json.load(f)
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a trace-event array")
    return events


def merge(out: str | Path, inputs: list) -> int:
    """Writes the events of every file in `inputs` to `out`, ordered by time; returns how many."""
    metadata, timed = [], []
    for path in inputs:
        for event in load(path):
            (metadata if event.get("ph") == "M" else timed).append(event)
    timed.sort(key=lambda e: (e.get("ts", 0), e.get("pid", 0)))
    with open(out, "w") as f:
        json.dump(metadata + timed, f)
    return len(metadata) + len(timed)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perseus_legacy.timeline",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="merge ranks' timeline files into one trace")
    merging.add_argument("out")
    merging.add_argument("inputs", nargs="+")
    args = parser.parse_args(argv)
    count = merge(args.out, args.inputs)
    print(f"{args.out}: {count} events from {len(args.inputs)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
