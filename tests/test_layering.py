"""The source's folders follow its processes, and the rules of who may import whom hold everywhere.

Every module of ``sparktrain`` has one role (:data:`ROLES`, the process it runs in); a role never
imports the roles :data:`FORBIDDEN` names: a rank knows only what it was given, a node never
calls back into the caller, the contract and the pure values import no process. Checked two
ways: every import statement in the source (those inside functions too), and what importing
each module really loads. ``docs/architecture.md`` shows the same two tables; a test keeps them
equal.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sparktrain

PACKAGE = Path(sparktrain.__file__).parent
DOCS = PACKAGE.parents[1] / "docs" / "architecture.md"

#: Each role: the folders and modules (relative to the package) whose code runs in that process.
#: The longest match names a module's role.
ROLES: dict[str, tuple[str, ...]] = {
    "face": (
        "__init__.py", "__main__.py", "cli.py", "compat/", "tuning/", "spark/__init__.py",
        "inference/__init__.py",
    ),
    "driver": (
        "driver/", "ray/", "doctor/", "tracking/driver.py", "spark/", "inference/api.py",
        "inference/models.py", "inference/planning.py",
    ),
    "node": ("node/",),
    "rank": (
        "rank/", "strategies/", "data/", "horovod/", "tracking/__init__.py", "tracking/rank.py",
        "compat/tensorflow_rank.py", "compat/barrier_context.py", "spark/training.py",
        "spark/tasks.py", "spark/scoring.py", "spark/loop/",
        "inference/", "elastic.py", "checkpoint.py",
    ),
    "plan": ("launchplan/",),
    "contract": ("contract/",),
    "planner": ("planner/",),
    "ground": ("errors.py", "procfs.py", "proctree.py", "buildlock.py", "_version.py", "py.typed"),
}  # fmt: skip

#: role -> the roles it may not import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "rank": ("face", "driver", "node"),
    "node": ("face", "driver"),
    "plan": ("face", "driver", "node", "rank"),
    "contract": ("face", "driver", "node", "rank"),
    "planner": ("face", "driver", "node", "rank", "contract"),
    "ground": ("face", "driver", "node", "rank", "plan", "contract", "planner"),
}

#: The imports that cross a rule on purpose, each with its reason (module -> imported name).
ALLOWED: dict[tuple[str, str], str] = {
    ("horovod/__init__.py", "sparktrain.compat.horovod_run"): (
        "horovod.run is Horovod's front door; the alias package points to it, loaded on use"
    ),
    ("horovod/__init__.py", "sparktrain.compat.horovod_run.run"): "the same pointer",
}


def role_of(relative: str) -> str:
    """The role of a module, by the longest entry of :data:`ROLES` that names it."""
    found = [
        (len(entry), role)
        for role, entries in ROLES.items()
        for entry in entries
        if relative == entry or (entry.endswith("/") and relative.startswith(entry))
    ]
    if not found:
        raise AssertionError(f"{relative} has no role: add it to ROLES (and docs/architecture.md)")
    return max(found)[1]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def _module_file(name: str) -> str | None:
    """The module (relative to the package) of a dotted ``sparktrain...`` name."""
    parts = name.split(".")[1:]
    while parts:
        for candidate in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (PACKAGE / candidate).exists():
                return candidate
        parts = parts[:-1]
    return "__init__.py" if name == "sparktrain" else None


def _module_role(name: str) -> str | None:
    """The role of a dotted ``sparktrain...`` name (a module, or a name inside one)."""
    found = _module_file(name)
    return role_of(found) if found else None


def _is_package(name: str) -> bool:
    return (PACKAGE.joinpath(*name.split(".")[1:]) / "__init__.py").exists()


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "sparktrain" or n.startswith("sparktrain.")}


def crossings(relative: str, names: set[str]) -> list[str]:
    """The imports among ``names`` (made by module ``relative``) that break a rule."""
    role = role_of(relative)
    bad = []
    for name in sorted(names):
        target = _module_role(name)
        if target in FORBIDDEN.get(role, ()) and (relative, name) not in ALLOWED:
            bad.append(f"{relative} ({role}) imports {name} ({target})")
    return bad


def test_every_module_has_a_role() -> None:
    assert [role_of(m) for m in _modules()]  # raises, naming the module, when one has none


def test_no_import_statement_breaks_a_rule() -> None:
    bad = [b for m in _modules() for b in crossings(m, _imported(PACKAGE / m))]
    assert not bad, "\n".join(bad)


def test_the_rule_check_fails_on_a_rank_package_importing_the_driver() -> None:
    """Put an import of ``driver/`` back into ``horovod/`` and the check names it."""
    assert crossings("horovod/alias.py", {"sparktrain.driver.launch"}) == [
        "horovod/alias.py (rank) imports sparktrain.driver.launch (driver)"
    ]
    assert crossings("strategies/zero.py", {"sparktrain.node.runner.NodeRun"})
    assert crossings("contract/spec.py", {"sparktrain.rank.worker"})
    assert not crossings("driver/launch.py", {"sparktrain.rank.worker"})


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_importing_a_module_loads_nothing_it_may_not_import(role: str) -> None:
    modules = [
        "sparktrain." + m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for m in _modules()
        if role_of(m) == role and m != "__main__.py"
    ]
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sparktrain.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # A package's __init__ loads with any module inside it; what the __init__ imports still counts.
    modules_loaded = [m for m in loaded if not _is_package(m)]
    bad = [m for m in modules_loaded if _module_role(m) in FORBIDDEN[role]]
    allowed = {name for (_, name) in ALLOWED}
    assert not [m for m in bad if m not in allowed], bad


def test_the_architecture_page_shows_these_rules() -> None:
    """docs/architecture.md's role table holds the same roles, folders and forbidden imports."""
    text = DOCS.read_text()
    for role, entries in ROLES.items():
        row = re.search(rf"^\| `{role}` \|([^|]*)\|([^|]*)\|", text, re.MULTILINE)
        assert row, f"docs/architecture.md has no row for the role {role!r}"
        shown = set(re.findall(r"`([^`]+)`", row.group(1)))
        assert shown == set(entries), (role, sorted(shown ^ set(entries)))
        never = set(re.findall(r"`([^`]+)`", row.group(2)))
        assert never == set(FORBIDDEN.get(role, ())), (role, sorted(never))


def test_result_types_load_no_fork_server_code() -> None:
    """``sparktrain.RunResult`` (and the errors) cost the caller nothing: no fork server, no
    worker, no agent, no cloudpickle, no exit hook."""
    code = (
        "import atexit, sys, sparktrain\n"
        "sparktrain.RunResult, sparktrain.RunOptions, sparktrain.TrainingFailedError\n"
        "heavy = ('sparktrain.node.warm', 'sparktrain.node.forkserver', 'sparktrain.node.agent',"
        " 'sparktrain.rank.worker', 'cloudpickle', 'torch')\n"
        "print([m for m in heavy if m in sys.modules], atexit._ncallbacks())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 0"


#: Where each role stands on farm-studio's whiteboard ([column, row]) and what it says there.
BOARD: dict[str, tuple[tuple[int, int], str]] = {
    "face": ((2, 0), "front doors: launch, CLI, compat, tune, Spark ML, inference"),
    "driver": ((0, 2), "the caller's process: attempt loop, backends, follow"),
    "plan": ((5, 3), "layout, options, policy: pure values"),
    "node": ((0, 5), "one per machine: runner, agent, fork server"),
    "rank": ((3, 3), "inside the training function: strategies, data, scoring"),
    "contract": ((5, 5), "the wire: channel, spec, report, env, paths"),
    "planner": ((1, 7), "memory planner, pure arithmetic"),
    "ground": ((3, 7), "errors, /proc, the build lock"),
}


def whiteboard() -> dict[str, object]:
    """farm-studio's whiteboard (``../shared/roles-whiteboard.json``) drawn from these rules:
    a part per role, the arrows the import statements have today, a never per forbidden import.
    ``python tests/test_layering.py > /tmp/studio/wb.json`` writes it."""
    prefix = "src/sparktrain/"
    allowed = {module for module, _ in ALLOWED}

    def part(module: str) -> str:
        return "Allowed" if module in allowed else role_of(module).capitalize()

    imports = [(m, _module_file(n)) for m in _modules() for n in _imported(PACKAGE / m)]
    arrows = {(part(m), part(f)) for m, f in imports if f and part(f) != part(m)}
    parts = {
        role.capitalize(): {
            "is": [prefix + e for e in entries if e != "py.typed"],
            "says": BOARD[role][1],
            "at": list(BOARD[role][0]),
        }
        for role, entries in ROLES.items()
    }
    parts["Allowed"] = {  # the modules whose crossings ALLOWED names stand on a part of their own
        "is": sorted(prefix + module for module in allowed),
        "says": "crossings on purpose: test_layering's ALLOWED",
        "at": [4, 0],
    }
    return {
        "parts": parts,
        "arrows": sorted([a, b] for a, b in arrows),
        "never": [
            [role.capitalize(), other.capitalize(), f"test_layering: {role} never imports {other}"]
            for role, others in FORBIDDEN.items()
            for other in others
        ],
    }


if __name__ == "__main__":
    print(json.dumps(whiteboard(), indent=1))
