"""The rules of a 4x4 Sudoku grid (digits 1-4, 2x2 boxes), shared by the task and the file
reader: a grid is a 16-character row-major string."""

from __future__ import annotations

import re

# Rows, columns and 2x2 boxes as lists of cell indices; PEERS[i] = cells sharing a unit with i.
UNITS = (
    [[4 * r + c for c in range(4)] for r in range(4)]
    + [[4 * r + c for r in range(4)] for c in range(4)]
    + [
        [4 * (br + r) + bc + c for r in range(2) for c in range(2)]
        for br in (0, 2)
        for bc in (0, 2)
    ]
)
PEERS = [sorted({j for unit in UNITS if i in unit for j in unit} - {i}) for i in range(16)]

_GRID_RE = re.compile(r"[1-4]{16}")


def is_valid_grid(grid: str) -> bool:
    """True when ``grid`` is 16 digits 1-4 with every row, column and box a permutation of 1-4."""
    return bool(_GRID_RE.fullmatch(grid)) and all(
        len({grid[i] for i in unit}) == 4 for unit in UNITS
    )
