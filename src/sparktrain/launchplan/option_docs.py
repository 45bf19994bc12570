"""The run options as people read them: the command line's flags and the front doors' docstrings.

Both are made from the groups' fields (:mod:`sparktrain.launchplan.options`): each field's
``help``, its default, and how the command line parses it. So ``sparktrain run --help`` and the
documentation of every front door (``launch``, ``TorchDistributor``, ...) list every option the
moment a group gains one, under its group's name.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

from sparktrain.launchplan.options import GROUPS, fields

#: Where a front door's docstring lists the run options (:func:`documents_options`).
OPTIONS_MARK = "{run_options}"


def cli_options() -> list[tuple[str, Any, str]]:
    """``(name, parse, help)`` of each option that the command line takes."""
    return [
        (item.name, item.metadata["cli"], item.metadata["help"])
        for _, item in fields()
        if item.metadata["cli"] is not None
    ]


def options_doc(indent: str) -> str:
    """Every run option as docstring lines, group by group: ``name`` (its default): its help."""
    lines = []
    for group in GROUPS:
        lines.append(f"{indent}*{group}* (``{GROUPS[group].__name__}``):")
        for _, item in (pair for pair in fields() if pair[0] == group):
            first = f"{indent}- ``{item.name}`` (default ``{item.default!r}``): "
            wrapped = textwrap.wrap(
                item.metadata["help"] + ".",
                width=100,
                initial_indent=first,
                subsequent_indent=indent + "  ",
            )
            lines.extend(wrapped)
    return "\n".join(lines)


_F = TypeVar("_F", bound=Callable[..., Any])


def documents_options(func: _F) -> _F:
    """Write every run option into ``func``'s docstring where it says ``{run_options}``.

    The list is made from the groups' fields, so a front door's documentation names every
    option the moment one is added. The mark stands alone on its line; its indentation is the
    list's.
    """
    doc = func.__doc__
    if doc is None:  # python -OO
        return func
    for line in doc.splitlines():
        if line.strip() == OPTIONS_MARK:
            indent = line[: len(line) - len(line.lstrip())]
            func.__doc__ = doc.replace(line, options_doc(indent))
            return func
    raise AssertionError(f"{func.__qualname__}'s docstring has no line {OPTIONS_MARK}")
