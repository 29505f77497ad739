"""Every runnable example of the documentation runs on real ranks and checks its own result.

A block fenced as ```python run=N (README.md and docs/*.md) is written to a file and launched
on N ranks with perseusrun; plain ```python blocks are illustrative and not run. A block that
fails, or outlives its timeout, fails its test with every rank's output.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import ROOT, run_ranks

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\s+run=(\d+)\s*$")
TIMEOUT_SECONDS = 180


def runnable_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(id "file:line", ranks, code) of every ```python run=N block in `path`."""
    blocks = []
    lines = path.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if start is None:
            match = FENCE.match(line)
            if match:
                start, ranks, code = number, int(match.group(1)), []
        elif line.startswith("```"):
            blocks.append((f"{path.relative_to(ROOT)}:{start}", ranks, "\n".join(code) + "\n"))
            start = None
        else:
            code.append(line)
    assert start is None, f"{path.relative_to(ROOT)}:{start}: runnable block is never closed"
    return blocks


BLOCKS = [block for path in DOC_FILES for block in runnable_blocks(path)]


def test_readme_has_runnable_blocks():
    assert any(where.startswith("README.md:") for where, _, _ in BLOCKS), (
        "no ```python run=N block found in README.md: the collector found nothing")


@pytest.mark.parametrize(("where", "ranks", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_block_runs_and_checks_itself(where, ranks, code, tmp_path):
    assert ranks in (1, 2), f"{where}: run={ranks}; blocks run on 1 or 2 ranks"
    script = tmp_path / "doc_block.py"
    script.write_text(f"# {where}\n{code}")
    try:
        run_ranks(ranks, str(script), timeout=TIMEOUT_SECONDS)
    except AssertionError as exc:
        raise AssertionError(f"the example at {where} failed:\n{exc}") from None
