"""House rules on the source's shape: no function over 60 lines of code, no module over 400 lines.

A function's lines of code are counted with ``ast`` and ``tokenize``: its lines from the ``def``
to its last line (the signature counts, and a nested function counts within its parent), less
blank lines, comment lines and docstrings. A long function is split into named helpers; a long
public signature stays (its keywords are the API), and its body gets shorter.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from pathlib import Path

import sparktrain

PACKAGE = Path(sparktrain.__file__).parent
MAX_LINES = 60
#: Functions allowed over the limit for now, and why. Each must still be over it: once one is
#: not, its entry goes.
EXEMPT: dict[str, str] = {}
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
    tokenize.ENCODING,
}
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _code_lines(source: str) -> set[int]:
    """The lines that hold code: a token other than a comment, a line end or indentation."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The lines of every docstring: the module's, the classes' and the functions'."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, *_FUNCTIONS)) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(name, line of its def, lines of code)`` of every function in ``source``."""
    tree = ast.parse(source)
    code = _code_lines(source) - _docstring_lines(tree)
    return [
        (node.name, node.lineno, sum(node.lineno <= n <= (node.end_lineno or 0) for n in code))
        for node in ast.walk(tree)
        if isinstance(node, _FUNCTIONS)
    ]


def long_functions(root: Path, limit: int) -> list[tuple[str, int, int]]:
    """``("path:name", line, lines of code)`` of each function under ``root`` over ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for name, line, count in function_lengths(path.read_text(encoding="utf-8")):
            if count > limit:
                found.append((f"{where}:{name}", line, count))
    return found


@functools.cache
def _package_over_the_limit() -> list[tuple[str, int, int]]:
    return long_functions(PACKAGE, MAX_LINES)


def test_no_function_is_over_the_limit() -> None:
    offenders = [f for f in _package_over_the_limit() if f[0] not in EXEMPT]
    listed = "\n".join(
        f"  {name} (line {line}): {count} lines"
        for name, line, count in sorted(offenders, key=lambda f: -f[2])
    )
    assert not offenders, (
        f"functions over {MAX_LINES} lines of code (signature included; docstrings, comments "
        f"and blank lines not counted) in {PACKAGE}:\n{listed}\nsplit each into named helpers "
        "(argument checks into a helper that returns a frozen value, one step per function)."
    )


def test_every_exemption_is_still_needed() -> None:
    over = {name for name, _, _ in _package_over_the_limit()}
    stale = sorted(set(EXEMPT) - over)
    assert not stale, f"{stale} are {MAX_LINES} lines or fewer now: remove them from EXEMPT."


def _statements(count: int, indent: str = "    ") -> str:
    return "\n".join(f"{indent}x{i} = {i}" for i in range(count))


def test_the_count_flags_a_long_function(tmp_path: Path) -> None:
    header = 'def at_limit(\n    a: int,\n) -> None:\n    """Doc.\n\n    More doc.\n    """\n'
    (tmp_path / "at_limit.py").write_text(
        f"{header}    # a comment\n\n{_statements(MAX_LINES - 3)}\n"  # the signature's 3 lines
    )
    assert long_functions(tmp_path, MAX_LINES) == []
    (tmp_path / "nested.py").write_text(
        'def outer():\n    def inner():\n        """Doc."""\n        return 1\n\n'
        f"{_statements(MAX_LINES - 2)}\n"
    )
    assert long_functions(tmp_path, MAX_LINES) == [("nested.py:outer", 1, MAX_LINES + 1)]


def test_strings_and_comments_are_told_apart() -> None:
    source = (
        "def f():\n"
        '    """Doc.\n\n    # not a comment: the docstring\n    """\n'
        "    # a comment\n"
        '    text = """\n# in a string: code\n\n"""\n'
        "    return text  # a trailing comment\n"
    )
    assert function_lengths(source) == [("f", 1, 6)]


MAX_FILE_LINES = 400


def test_no_module_is_over_the_file_limit() -> None:
    """A module past 400 lines holds more than one concept: split it by responsibility."""
    over = {
        path.relative_to(PACKAGE).as_posix(): count
        for path in sorted(PACKAGE.rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    }
    assert not over, f"modules over {MAX_FILE_LINES} lines: {over}"
