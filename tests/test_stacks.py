"""Reading a hung rank's faulthandler dump: the rank's own thread, the user's frame, whole dumps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sparktrain.node import stacks

SITE = "/home/u/proj"
TORCH = f"{SITE}/venv/lib/python3.11/site-packages/torch/distributed"
MAIN = f"""Current thread 0x00007f0000000001 (most recent call first):
  File "{TORCH}/distributed_c10d.py", line 3252 in all_reduce
  File "{TORCH}/c10d_logger.py", line 83 in wrapper
  File "{SITE}/train.py", line 41 in train
  File "{SITE}/src/sparktrain/rank/worker.py", line 191 in _run_entry
  File "{SITE}/src/sparktrain/rank/worker.py", line 278 in run_rank
  File "{SITE}/src/sparktrain/node/forkserver.py", line 268 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
HELPER = f"""Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "{SITE}/train.py", line 12 in _beat
  File "/usr/lib/python3.11/threading.py", line 982 in run
"""


def test_the_ranks_thread_is_read_even_when_the_signal_landed_elsewhere() -> None:
    # A signal delivered to a C++ thread (gloo's) marks no Python thread as current, and
    # faulthandler lists the newest thread first: the user's helper, not the rank.
    unmarked = HELPER + "\n" + MAIN.replace("Current thread", "Thread")
    site = stacks.parse(unmarked, rank=0)
    assert site is not None
    assert (site.function, site.user_file, site.user_line) == ("all_reduce", f"{SITE}/train.py", 41)


def test_a_project_in_a_folder_named_like_a_library_is_the_users() -> None:
    # A clone called sparktrain (the fresh-clone CI's layout), a project under a torch/ folder.
    for project in ("/tmp/fresh/sparktrain/tests", "/home/u/torch/experiments"):
        dump = MAIN.replace(f"{SITE}/train.py", f"{project}/train.py")
        site = stacks.parse(dump, rank=0)
        assert site is not None
        assert (site.user_file, site.user_line) == (f"{project}/train.py", 41), site.stack
    ours = MAIN.replace(f"{SITE}/train.py", f"{SITE}/src/sparktrain/rank/checkpoint.py")
    site = stacks.parse(ours, rank=0)  # sparktrain's own file (wherever it is) is not
    assert site is not None and site.user_file == f"{TORCH}/distributed_c10d.py"  # no user frame


def test_a_dump_still_being_written_is_not_read_half(tmp_path: Path) -> None:
    path = tmp_path / "stack-0.txt"
    lines = MAIN.splitlines(keepends=True)
    path.write_text("".join(lines[:2]))  # the header and the innermost frame only, so far

    def finish() -> None:
        time.sleep(0.35)  # past collect's first look
        with path.open("a") as out:
            out.write("".join(lines[2:]))

    writer = threading.Thread(target=finish)
    writer.start()
    sites = stacks.collect({0: path}, within=3.0)
    writer.join()
    assert sites[0].user_file == f"{SITE}/train.py" and sites[0].user_line == 41


def test_an_empty_dump_gives_no_site(tmp_path: Path) -> None:
    path = tmp_path / "stack-1.txt"
    path.touch()
    assert stacks.collect({1: path}, within=0.5) == {}


def test_a_dump_cut_short_is_still_read_when_time_runs_out(tmp_path: Path) -> None:
    path = tmp_path / "stack-2.txt"
    path.write_text("".join(MAIN.splitlines(keepends=True)[:4]))  # the rank never finished it
    sites = stacks.collect({2: path}, within=0.5)
    assert sites[2].function == "all_reduce" and sites[2].user_line == 41
