"""``sparktrain.report()`` reaches the driver: ``on_report``, stopping a run, the progress bar."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import cloudpickle
import nbformat
import pytest
from nbclient import NotebookClient

import sparktrain
from sparktrain import launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SRC = Path(__file__).resolve().parents[1] / "src"


def _steps(total: int, pause: float) -> int:
    rank = int(os.environ["RANK"])
    for step in range(1, total + 1):
        time.sleep(pause)
        sparktrain.report(step=step, total=total, loss=1.0 / step, rank=rank)
    return rank


def test_reports_reach_on_report_in_order() -> None:
    seen: list[tuple[int, dict[str, Any]]] = []
    result = launch(
        _steps,
        (5, 0.06),
        num_processes=2,
        use_gpu=False,
        progress=False,
        on_report=lambda rank, record: seen.append((rank, record)),
    )
    assert result.value == 0 and not result.stopped
    for rank in (0, 1):
        steps = [r["step"] for k, r in seen if k == rank]
        assert steps == [1, 2, 3, 4, 5]  # 60 ms apart: none coalesced, none lost
        last = next(r for k, r in reversed(seen) if k == rank)
        assert last["total"] == 5 and last["metrics"] == {"loss": 0.2, "rank": rank}


def _resumes_then_reports(folder: str) -> int:
    import torch.distributed as dist

    from sparktrain import checkpoint

    dist.init_process_group("gloo")
    checkpoint.save({"x": 1}, folder, step=1)
    checkpoint.load_latest(folder)  # in an elastic run, tells the driver the step it resumed
    sparktrain.report(step=2, loss=0.5)
    dist.destroy_process_group()
    return 0


def test_on_report_sees_only_the_users_records_in_an_elastic_run(tmp_path: Path) -> None:
    seen: list[tuple[int, Any, dict[str, Any]]] = []
    launch(
        _resumes_then_reports,
        (str(tmp_path / "ckpt"),),
        num_processes=2,
        min_processes=1,
        use_gpu=False,
        progress=False,
        on_report=lambda rank, record: seen.append((rank, record["step"], record["metrics"])),
    )
    assert sorted(seen) == [(0, 2, {"loss": 0.5}), (1, 2, {"loss": 0.5})]


def _flood(count: int) -> int:
    for step in range(1, count + 1):
        sparktrain.report(step=step, loss=float(step))
    return count


def test_a_flood_of_reports_is_coalesced_and_the_last_one_arrives() -> None:
    seen: list[dict[str, Any]] = []
    result = launch(
        _flood,
        (20_000,),
        num_processes=1,
        use_gpu=False,
        progress=False,
        on_report=lambda rank, record: seen.append(record),
    )
    assert result.value == 20_000
    assert seen[-1]["step"] == 20_000 and seen[-1]["metrics"] == {"loss": 20_000.0}
    assert len(seen) < 2_000  # coalesced: the rank did not write 20,000 lines
    assert [r["step"] for r in seen] == sorted(r["step"] for r in seen)


def _forever() -> None:
    step = 0
    while True:
        step += 1
        sparktrain.report(step=step)
        time.sleep(0.01)


def test_on_report_returning_true_stops_every_rank() -> None:
    result = launch(
        _forever,
        num_processes=2,
        use_gpu=False,
        progress=False,
        timeout=120,
        on_report=lambda rank, record: rank == 0 and record["step"] >= 20,
    )
    assert result.stopped
    assert result.value is None  # no rank returned


def test_an_error_in_on_report_stops_the_run_and_is_raised() -> None:
    def explode(rank: int, record: dict[str, Any]) -> None:
        raise KeyError("from on_report")

    with pytest.raises(KeyError, match="from on_report"):
        launch(_forever, num_processes=2, use_gpu=False, timeout=120, on_report=explode)


def _loop_with_progress(n: int) -> int:
    return sum(1 for _ in sparktrain.progress(range(n), epoch=1))


def test_progress_wraps_a_loop_and_reports_its_length() -> None:
    seen: list[dict[str, Any]] = []
    result = launch(
        _loop_with_progress,
        (7,),
        num_processes=1,
        use_gpu=False,
        progress=False,
        on_report=lambda rank, record: seen.append(record),
    )
    assert result.value == 7
    assert seen[-1]["step"] == 7 and seen[-1]["total"] == 7
    assert seen[-1]["metrics"] == {"epoch": 1}


def test_report_outside_a_launch_does_nothing() -> None:
    sparktrain.report(step=1, loss=0.5)  # no pipe: no error, no output
    assert list(sparktrain.progress([1, 2])) == [1, 2]


SCRIPT = textwrap.dedent(
    """
    import time
    import sparktrain

    def train(steps):
        for step in range(1, steps + 1):
            time.sleep(0.1)
            if step == 3:
                print("halfway there")
            sparktrain.report(step=step, total=steps, loss=round(1.0 / step, 3))
        return "done"

    if __name__ == "__main__":
        print(sparktrain.launch(train, (12,), num_processes=2, use_gpu=False).value)
    """
)


def _run_in_pty(script: Path) -> str:
    """Run ``script`` with its stdout and stderr on a pseudo-terminal; return what it drew."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "120"}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 4096)
                except OSError:  # the pty closed: the script exited
                    break
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(leader)
        proc.kill() if proc.poll() is None else None
        proc.wait()
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_in_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "bar.py"
    script.write_text(SCRIPT)
    drawn = _run_in_pty(script)
    assert "12/12" in drawn  # the bar reached the known length
    assert "loss=0.083" in drawn  # with the latest metrics
    assert "step/s" in drawn or "s/step" in drawn  # and a rate
    assert "[rank 0] halfway there" in drawn and "[rank 1] halfway there" in drawn
    assert drawn.rstrip().endswith("done")


def test_no_bar_when_the_output_is_not_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "bar.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "[rank 1] halfway there" in out.stdout and out.stdout.rstrip().endswith("done")
    assert "12/12" not in out.stderr + out.stdout


@pytest.mark.slow
def test_progress_bar_in_a_jupyter_kernel(tmp_path: Path) -> None:
    body = SCRIPT.split("if __name__")[0]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(SRC)!r})\n{body}"),
        nbformat.v4.new_code_cell(
            "sparktrain.launch(train, (12,), num_processes=2, use_gpu=False).value"
        ),
    ]
    NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    outputs = notebook.cells[1].outputs
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert "12/12" in stderr and "loss=0.083" in stderr
    assert "[rank 0] halfway there" in stdout
    result = next(o for o in outputs if o.output_type == "execute_result")
    assert result["data"]["text/plain"] == "'done'"


@pytest.mark.spark
def test_reports_and_stop_on_spark(spark: object) -> None:
    seen: list[tuple[int, int]] = []
    result = launch(
        _steps,
        (4, 0.06),
        num_processes=2,
        use_gpu=False,
        backend="spark",
        progress=False,
        on_report=lambda rank, record: seen.append((rank, record["step"])),
    )
    assert result.value == 0
    for rank in (0, 1):
        assert [s for k, s in seen if k == rank] == [1, 2, 3, 4]
    stopped = launch(
        _forever,
        num_processes=2,
        use_gpu=False,
        backend="spark",
        progress=False,
        timeout=120,
        on_report=lambda rank, record: record["step"] >= 10,
    )
    assert stopped.stopped and stopped.value is None
