"""The source's folders by role, and the rules of who may import whom: the data of the role test.

Every folder of ``sparktrain`` has one role, the process its code runs in (:data:`ROLES`); a
module's role is its folder's, so a path says where a module runs. A role never imports the
roles :data:`FORBIDDEN` names: a rank knows only what it was given, a node never calls back
into the caller, the driver never calls a front door, the contract and the pure values import
no process. ``tests/test_layering.py`` checks the rules on every import statement (those inside
functions and under ``TYPE_CHECKING`` too) and on what importing each module really loads;
``tests/draw_architecture.py`` draws them (``docs/images/architecture.svg``).
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sparktrain

PACKAGE = Path(sparktrain.__file__).parent

#: Each role: the folders (relative to the package; ``.`` is the package's own folder, a ``*``
#: stands for any one folder) whose modules run in that process. A folder entry ending in ``/``
#: covers its subfolders too; the most specific entry names a folder's role.
ROLES: dict[str, tuple[str, ...]] = {
    "face": (".", "compat/", "tuning/", "doctor/", "spark/", "inference/", "horovod/", "ray/"),
    "driver": ("driver/", "backends/"),
    "node": ("node/", "backends/*/node/"),
    "rank": (
        "rank/", "data/", "strategies/", "tracking/", "compat/rank/", "spark/rank/",
        "inference/rank/", "horovod/torch/",
    ),
    "plan": ("launchplan/",),
    "contract": ("contract/",),
    "planner": ("planner/",),
    "ground": ("ground/",),
}  # fmt: skip

#: role -> the roles it may not import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "driver": ("face",),
    "node": ("face", "driver"),
    "rank": ("face", "driver", "node"),
    "plan": ("face", "driver", "node", "rank"),
    "contract": ("face", "driver", "node", "rank"),
    "planner": ("face", "driver", "node", "rank", "contract"),
    "ground": ("face", "driver", "node", "rank", "plan", "contract", "planner"),
}

#: What each role is, in a few words (the architecture page and the diagram say the same).
SAYS: dict[str, str] = {
    "face": "the caller's front doors: launch, CLI, compat, tune, Spark ML, inference",
    "driver": "the caller's process: the attempt loop, follow, results; the backends' wings",
    "node": "one per machine: the node runner, its agent, the fork server; a wing's node body",
    "rank": "inside a rank: worker, strategies, data, tracking, a front door's rank side",
    "plan": "pure values: layout, options, policy, entrypoint",
    "contract": "what crosses a process: env, spec, reports, channel, paths",
    "planner": "the memory planner: pure arithmetic",
    "ground": "errors, /proc, process trees, the build lock, the version",
}


def _specificity(entry: str) -> int:
    return 0 if entry == "." else entry.rstrip("/").count("/") + 1


def _covers(entry: str, folder: str) -> bool:
    """Whether ``entry`` covers ``folder`` (``""`` is the package's own folder)."""
    if entry == ".":
        return folder == ""
    parts, wanted = folder.split("/") if folder else [], entry.rstrip("/").split("/")
    return len(parts) >= len(wanted) and all(
        fnmatch.fnmatchcase(part, pattern) for part, pattern in zip(parts, wanted, strict=False)
    )


def folder_role(folder: str) -> str:
    """The role of a folder (relative to the package, ``""`` for its own), by its most specific
    entry in :data:`ROLES`.

    Raises:
        AssertionError: No entry covers the folder: add it to ROLES (and docs/architecture.md).
    """
    found = [
        (_specificity(entry), role)
        for role, entries in ROLES.items()
        for entry in entries
        if _covers(entry, folder)
    ]
    if not found:
        raise AssertionError(
            f"the folder {folder or '.'!r} has no role: add it to ROLES (and docs/architecture.md)"
        )
    best = max(rank for rank, _ in found)
    roles = {role for rank, role in found if rank == best}
    if len(roles) > 1:
        raise AssertionError(f"the folder {folder!r} has two roles: {sorted(roles)}")
    return roles.pop()


def role_of(relative: str) -> str:
    """The role of a module (its path relative to the package): its folder's."""
    return folder_role(relative.rpartition("/")[0])


def modules() -> list[str]:
    """Every module of the package, relative to it."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def folders() -> list[str]:
    """Every folder of the package that holds a module (``""``: the package's own)."""
    return sorted({m.rpartition("/")[0] for m in modules()})


def module_file(name: str) -> str | None:
    """The module (relative to the package) of a dotted ``sparktrain...`` name."""
    parts = name.split(".")[1:]
    while parts:
        for candidate in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (PACKAGE / candidate).exists():
                return candidate
        parts = parts[:-1]
    return "__init__.py" if name == "sparktrain" else None


def module_role(name: str) -> str | None:
    """The role of a dotted ``sparktrain...`` name (a module, or a name inside one)."""
    found = module_file(name)
    return role_of(found) if found else None


@dataclass(frozen=True)
class Import:
    """One import statement's name of ``sparktrain``, where it stands, and its comment."""

    name: str
    line: int
    comment: str


def imports(path: Path) -> Iterator[Import]:
    """The ``sparktrain`` names every import statement of ``path`` imports (nested ones too)."""
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        above = lines[node.lineno - 2] if node.lineno > 1 else ""
        comment = " ".join(part for part in (above, lines[node.lineno - 1]) if "#" in part)
        for name in names:
            if name == "sparktrain" or name.startswith("sparktrain."):
                yield Import(name, node.lineno, comment)


def crossings(relative: str, names: set[str]) -> list[str]:
    """The imports among ``names`` (made by module ``relative``) that break a rule."""
    role = role_of(relative)
    bad = []
    for name in sorted(names):
        target = module_role(name)
        if target in FORBIDDEN.get(role, ()):
            bad.append(f"{relative} ({role}) imports {name} ({target})")
    return bad


def graph() -> dict[str, set[str]]:
    """Module -> the modules its import statements name (all of them, lazy and typing ones)."""
    edges: dict[str, set[str]] = {}
    for module in modules():
        found = {module_file(i.name) for i in imports(PACKAGE / module)}
        edges[module] = {f for f in found if f is not None and f != module}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each set of modules that import each other in a loop, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's strongly connected components, without recursion
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)
