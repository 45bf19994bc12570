"""The source's folders follow its processes, and the rules of who may import whom hold everywhere.

The rules are data (``tests/roles.py``): every folder has one role, a role never imports the
roles it may not. Checked three ways: every import statement in the source (those inside
functions and under ``TYPE_CHECKING`` too), what importing each module really loads, and the
import circles (none across folders; one inside a folder says why in a ``circle:`` comment).
``docs/architecture.md`` shows the same table, and ``docs/images/architecture.svg`` is drawn
from the same data and imports; tests keep both equal to the code.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from draw_architecture import IMAGE, draw
from roles import (
    FORBIDDEN,
    PACKAGE,
    ROLES,
    SAYS,
    circles,
    crossings,
    folder_role,
    folders,
    graph,
    imports,
    module_file,
    module_role,
    modules,
    role_of,
)

DOCS = PACKAGE.parents[1] / "docs" / "architecture.md"


def _is_package(name: str) -> bool:
    return (PACKAGE.joinpath(*name.split(".")[1:]) / "__init__.py").exists()


def test_every_folder_has_one_role() -> None:
    assert {folder: folder_role(folder) for folder in folders()}  # raises, naming the folder


def test_a_folder_without_a_role_is_named() -> None:
    with pytest.raises(AssertionError, match="the folder 'elsewhere' has no role"):
        folder_role("elsewhere")


def test_roles_follow_folders_alone() -> None:
    """A module's role is its folder's: a wing's node body is a node, its folder a driver's."""
    assert role_of("backends/spark/node/task.py") == "node"
    assert role_of("backends/spark/slots.py") == "driver"
    assert role_of("backends/newwing/node/body.py") == "node"  # a new wing needs no new entry
    assert role_of("spark/rank/loop/epochs.py") == "rank"
    assert role_of("spark/estimator.py") == "face"
    assert role_of("cli.py") == "face"
    assert role_of("horovod/torch/collectives.py") == "rank"
    for entries in ROLES.values():
        assert all(entry == "." or entry.endswith("/") for entry in entries), entries


def test_no_import_statement_breaks_a_rule() -> None:
    bad = [b for m in modules() for b in crossings(m, {i.name for i in imports(PACKAGE / m)})]
    assert not bad, "\n".join(bad)


def test_the_rule_check_fails_on_an_import_against_the_process_tree() -> None:
    """Put back a rank-to-front-door import (horovod.run from the rank's horovod), or another
    upward one, and the check names it."""
    assert crossings("horovod/torch/__init__.py", {"sparktrain.horovod.runner.run"}) == [
        "horovod/torch/__init__.py (rank) imports sparktrain.horovod.runner.run (face)"
    ]
    assert crossings("rank/horovod_alias.py", {"sparktrain.horovod"}) == [
        "rank/horovod_alias.py (rank) imports sparktrain.horovod (face)"
    ]
    assert crossings("strategies/zero.py", {"sparktrain.node.runner.NodeRun"})
    assert crossings("contract/spec.py", {"sparktrain.rank.worker"})
    assert crossings("backends/spark/node/task.py", {"sparktrain.backends.spark.slots"})
    assert crossings("driver/launch.py", {"sparktrain.compat.torch_distributor"})
    assert not crossings("driver/launch.py", {"sparktrain.rank.worker"})
    assert not crossings("backends/spark/backend.py", {"sparktrain.backends.spark.node.task"})


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_importing_a_module_loads_nothing_it_may_not_import(role: str) -> None:
    names = [
        "sparktrain." + m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for m in modules()
        if role_of(m) == role and m != "__main__.py"
    ]
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sparktrain.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # A package's __init__ loads with any module inside it; what the __init__ imports still counts.
    bad = [m for m in loaded if not _is_package(m) and module_role(m) in FORBIDDEN[role]]
    assert not bad, bad


def test_no_import_circle_spans_folders_and_each_one_inside_a_folder_says_why() -> None:
    edges = graph()
    found = circles(edges)
    across = [c for c in found if len({m.rpartition("/")[0] for m in c}) > 1]
    assert not across, f"import circles across folders: {across}"
    for circle in found:
        said = [
            f"{m}:{i.line}"
            for m in circle
            for i in imports(PACKAGE / m)
            if module_file(i.name) in circle and "circle:" in i.comment
        ]
        assert said, f"the import circle {circle} has no '# circle: why' on an import in it"


def test_the_circle_finder_finds_a_circle() -> None:
    edges = {"a/x.py": {"a/y.py"}, "a/y.py": {"b/z.py"}, "b/z.py": {"a/x.py"}, "c.py": set()}
    assert circles(edges) == [["a/x.py", "a/y.py", "b/z.py"]]
    assert circles({"a.py": {"b.py"}, "b.py": set()}) == []


def test_the_architecture_page_shows_these_rules() -> None:
    """docs/architecture.md's role table holds the same roles, folders and forbidden imports."""
    text = DOCS.read_text()
    for role, entries in ROLES.items():
        row = re.search(rf"^\| `{role}` \|([^|]*)\|([^|]*)\|([^|]*)\|", text, re.MULTILINE)
        assert row, f"docs/architecture.md has no row for the role {role!r}"
        shown = set(re.findall(r"`([^`]+)`", row.group(1)))
        assert shown == set(entries), (role, sorted(shown ^ set(entries)))
        never = set(re.findall(r"`([^`]+)`", row.group(2)))
        assert never == set(FORBIDDEN.get(role, ())), (role, sorted(never))
        assert row.group(3).strip() == SAYS[role], role


def test_the_architecture_drawing_is_drawn_from_the_code() -> None:
    """docs/images/architecture.svg is what tests/draw_architecture.py draws from the code now:
    run ``python tests/draw_architecture.py`` after moving a folder or an import."""
    assert IMAGE.read_text() == draw(), "run: python tests/draw_architecture.py"


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
