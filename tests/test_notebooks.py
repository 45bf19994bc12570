"""The notebook gallery: every notebook in ``notebooks/`` runs top to bottom in a fresh kernel.

Each notebook is executed through ``nbclient`` in a new Jupyter kernel of the interpreter running
the tests (the project's own install), in an empty working folder. A failing cell, the final
assertions included, fails the test. After the kernel shuts down, nothing it started may still
run. ``SPARKTRAIN_SAVE_NOTEBOOKS=1`` writes each executed notebook back over its file, which is
how the gallery's saved outputs are made.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT, _cmdline, descendants, wait_gone

GALLERY = ROOT / "notebooks"
NOTEBOOKS = sorted(GALLERY.glob("*.ipynb"))
SAVE = os.environ.get("SPARKTRAIN_SAVE_NOTEBOOKS") == "1"
#: One cell may take this long; a notebook should take under 2 minutes in all.
CELL_TIMEOUT = 300


def _execute(path: Path, workdir: Path) -> tuple[nbformat.NotebookNode, float, list[str]]:
    """Run ``path`` in a fresh kernel; return it executed, its seconds, and what outlived it."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.monotonic()
    with client.setup_kernel():
        assert client.km is not None
        kernel = client.km.provisioner.pid  # type: ignore[union-attr]
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        started = descendants(kernel)
    seconds = time.monotonic() - start
    left = wait_gone(started, within=30.0)
    return notebook, seconds, [_cmdline(pid) for pid in left]


@pytest.mark.slow
@pytest.mark.timeout(2 * CELL_TIMEOUT)  # (a loaded machine: each takes under 2 minutes here)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    notebook, seconds, left = _execute(path, tmp_path)
    print(f"{path.name}: {seconds:.1f} s")
    assert not left, f"{path.name} left processes running after its kernel stopped: {left}"
    if SAVE:
        nbformat.write(notebook, path)


def test_the_gallery_is_there() -> None:
    assert len(NOTEBOOKS) >= 15, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_saved_notebook_carries_its_outputs_and_ends_in_assertions(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cell"
    unrun = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} were saved without being run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was saved with an error: {errors[0].get('ename')}"
    assert re.search(r"^assert ", code[-1].source, re.M), f"{path.name}: last cell asserts nothing"
    streams = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "[rank 1" in streams, f"{path.name}: no rank-tagged log line in its saved outputs"
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_is_mapped_in_the_gallerys_readme(path: Path) -> None:
    readme = (GALLERY / "README.md").read_text()
    assert f"({path.name})" in readme, f"notebooks/README.md does not link {path.name}"


def test_every_relative_link_in_the_docs_points_at_a_file() -> None:
    pages = [ROOT / "README.md", GALLERY / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
