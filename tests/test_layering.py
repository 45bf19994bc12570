"""The run path's folders follow its processes: what runs in a rank never imports the node or the
driver, and the node never imports the driver. Checked two ways: every import statement in the
source (those inside functions too), and what importing each module really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sparktrain

PACKAGE = Path(sparktrain.__file__).parent
#: role -> the roles it may not import.
FORBIDDEN = {"rank": ("node", "driver"), "node": ("driver",), "launchplan": ("node", "driver")}


def _modules(role: str) -> list[Path]:
    return sorted((PACKAGE / role).glob("*.py"))


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_no_import_statement_crosses_upwards(role: str) -> None:
    bad = []
    for path in _modules(role):
        for name in _imported(path):
            if any(name.startswith(f"sparktrain.{above}") for above in FORBIDDEN[role]):
                bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not bad, bad


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_importing_a_module_loads_nothing_above_it(role: str) -> None:
    modules = [f"sparktrain.{role}.{p.stem}" for p in _modules(role) if p.stem != "__init__"]
    forbidden = [f"sparktrain.{above}." for above in FORBIDDEN[role]]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith(tuple({forbidden!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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
