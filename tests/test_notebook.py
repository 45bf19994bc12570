"""The quickstart notebook runs in a real Jupyter kernel and shows rank-tagged logs in its cell."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import EXAMPLES


@pytest.mark.slow
def test_quickstart_notebook(tmp_path: Path) -> None:
    notebook = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    run_cell = next(c for c in notebook.cells if "TorchDistributor(num_processes" in c.source)
    text = "".join(o.get("text", "") for o in run_cell.outputs if o.output_type == "stream")
    for rank in (0, 1):
        assert f"[rank {rank}] epoch 0 loss" in text
        assert f"[rank {rank}] epoch 1 loss" in text
    last = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
    assert last.startswith("Sequential accuracy")
    assert float(last.split()[-1]) > 0.5
