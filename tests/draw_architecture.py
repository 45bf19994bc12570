"""Draw ``docs/images/architecture.svg`` from the code: the folders by role, and who imports whom.

``python tests/draw_architecture.py`` writes it; ``tests/test_layering.py`` fails when the
drawing on disk is not what the code draws now. The top of the picture is a band per role, from
the caller's front doors down to the ground every process stands on, holding the folders of
that role. The bottom is the rules: a cell per pair of roles, marked where
the code imports (``uses``), where it may but does not (blank), and where it never may
(``never``). Only the code and ``tests/roles.py`` decide what is drawn; no layout is kept by hand.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from roles import FORBIDDEN, ROLES, SAYS, folder_role, folders, graph, role_of

IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "architecture.svg"

WIDTH = 1100
MARGIN = 20
LABEL = 150  # the band's title column
BOX_W, BOX_H, GAP = 196, 28, 8
PER_ROW = (WIDTH - 2 * MARGIN - LABEL) // (BOX_W + GAP)
CELL_W, CELL_H = 78, 26
COLOURS = {
    "face": "#dbeafe",
    "driver": "#e0e7ff",
    "node": "#ede9fe",
    "rank": "#dcfce7",
    "plan": "#fef9c3",
    "contract": "#ffedd5",
    "planner": "#fce7f3",
    "ground": "#e5e7eb",
}
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _text(x: float, y: float, text: str, size: int = 12, **attrs: str) -> str:
    extra = "".join(f" {key.replace('_', '-')}='{value}'" for key, value in attrs.items())
    return f"<text x='{x:g}' y='{y:g}' font-size='{size}' {FONT}{extra}>{escape(text)}</text>"


def _bands(top: float) -> tuple[list[str], float]:
    """A band per role with its folders' boxes; the SVG parts and the bottom's height."""
    parts: list[str] = []
    y = top
    for role in ROLES:
        mine = [f for f in folders() if folder_role(f) == role]
        rows = max(1, -(-len(mine) // PER_ROW))
        height = rows * (BOX_H + GAP) + GAP + 22
        parts.append(
            f"<rect x='{MARGIN}' y='{y:g}' width='{WIDTH - 2 * MARGIN}' height='{height}' "
            f"rx='8' fill='{COLOURS[role]}' stroke='#94a3b8'/>"
        )
        parts.append(_text(MARGIN + 10, y + 22, role, 16, font_weight="bold"))
        parts.append(_text(MARGIN + 10 + LABEL, y + 16, SAYS[role], 11, fill="#334155"))
        for n, folder in enumerate(mine):
            bx = MARGIN + LABEL + (n % PER_ROW) * (BOX_W + GAP)
            by = y + 22 + (n // PER_ROW) * (BOX_H + GAP)
            parts.append(
                f"<rect x='{bx}' y='{by:g}' width='{BOX_W}' height='{BOX_H}' rx='5' "
                "fill='white' stroke='#64748b'/>"
            )
            parts.append(_text(bx + 8, by + 19, (folder or "sparktrain") + "/", 12))
        y += height + GAP
    return parts, y


def _uses() -> set[tuple[str, str]]:
    """The pairs of roles (importer, imported) that some import statement joins."""
    return {
        (role_of(module), role_of(target))
        for module, targets in graph().items()
        for target in targets
        if role_of(module) != role_of(target)
    }


def _rules(top: float) -> tuple[list[str], float]:
    """The matrix of the rules: rows import columns; the SVG parts and the bottom's height."""
    roles = list(ROLES)
    uses = _uses()
    left = MARGIN + LABEL
    parts = [_text(MARGIN, top + 16, "who imports whom (a row imports a column)", 14)]
    top += 30
    for j, column in enumerate(roles):
        parts.append(_text(left + j * CELL_W + 6, top + 16, column, 11, font_weight="bold"))
    for i, row in enumerate(roles):
        y = top + (i + 1) * CELL_H
        parts.append(_text(MARGIN + 10, y + 17, row, 12, font_weight="bold"))
        for j, column in enumerate(roles):
            x = left + j * CELL_W
            never = column in FORBIDDEN.get(row, ())
            used = (row, column) in uses
            fill = "#fecaca" if never else ("#bbf7d0" if used else "white")
            word = "same" if row == column else ("never" if never else ("uses" if used else ""))
            parts.append(
                f"<rect x='{x}' y='{y}' width='{CELL_W - 2}' height='{CELL_H - 2}' "
                f"fill='{fill}' stroke='#cbd5e1'/>"
            )
            if word:
                parts.append(_text(x + 8, y + 17, word, 11, fill="#334155"))
    return parts, top + (len(roles) + 1) * CELL_H


def draw() -> str:
    """The whole drawing, as SVG text."""
    title = [
        _text(MARGIN, 28, "sparktrain: one folder, one role", 20, font_weight="bold"),
        _text(
            MARGIN,
            48,
            "drawn from the code by tests/draw_architecture.py; rules in tests/roles.py",
            11,
            fill="#475569",
        ),
    ]
    bands, bottom = _bands(64)
    rules, bottom = _rules(bottom + 16)
    height = int(bottom + MARGIN)
    return "\n".join(
        [
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
            f"viewBox='0 0 {WIDTH} {height}'>",
            f"<rect width='{WIDTH}' height='{height}' fill='white'/>",
            *title,
            *bands,
            *rules,
            "</svg>",
            "",
        ]
    )


if __name__ == "__main__":
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    IMAGE.write_text(draw())
    print(f"wrote {IMAGE}")
