"""The gloo teardown deadlock, measured: how often the DDP tutorial's function hangs, and why.

Each row is ``--runs`` back-to-back 2-rank launches (local backend, one caller) of the issue's
function: ``init_process_group("gloo")``, a ``DistributedDataParallel`` ``nn.Linear``, two
optimizer steps, ``destroy_process_group()``, return. A run that ``--timeout`` stops is a hang.
The rows change one thing inside the rank, before the function starts:

* ``sparktrain as shipped``: groups are kept alive until the rank's ``os._exit`` (the fix);
* ``fix off``: the original ``destroy_process_group`` is put back, so the group is destroyed
  when the DDP model is freed at the function's return, as anywhere else (torchrun, pyspark);
* ``fix off, no autograd TLS stash``: also ``torch._C._stash_obj_in_tls`` made a no-op (a
  diagnostic, never a fix): if the rows above differ and this one does not hang, the Python
  object in gloo's captured thread-local state is autograd's ``contextvars.Context``;
* ``fix off, switch interval 10 us``: the interpreter hands the GIL over 500 times as often.

    python benchmarks/teardown.py               # 60 runs a row, about 5 minutes
    python benchmarks/teardown.py --runs 20     # quicker, noisier
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import stress_patterns
from _common import leftover_processes, load_average, log, stop_strays, version_of

ROWS = {
    "sparktrain as shipped (groups kept until os._exit)": "shipped",
    "fix off (the group destroyed when DDP is freed)": "fix_off",
    "fix off, autograd's TLS stash disabled": "no_stash",
    "fix off, switch interval 10 us": "fast_switch",
}


def tutorial(variant: str) -> int:
    """The issue's function (``stress_patterns.destroy_then_return``), after changing one thing
    in this rank (see the module doc)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if variant != "shipped":
        original = distributed_c10d.destroy_process_group.__wrapped__  # type: ignore[attr-defined]
        dist.destroy_process_group = distributed_c10d.destroy_process_group = original
    if variant == "no_stash":
        torch._C._stash_obj_in_tls = lambda *args: None
        torch._C._remove_obj_from_tls = lambda *args: None
    if variant == "fast_switch":
        sys.setswitchinterval(1e-5)
    return stress_patterns.destroy_then_return()


def measure(variant: str, runs: int, timeout: float) -> tuple[int, int, float]:
    """(hangs, other failures, median seconds of the runs that ended)."""
    from sparktrain import TrainingFailedError, TrainingTimeoutError, launch

    hangs = failures = 0
    times = []
    for _ in range(runs):
        started = time.monotonic()
        try:
            value = launch(tutorial, (variant,), num_processes=2, use_gpu=False, timeout=timeout)
        except TrainingTimeoutError:
            hangs += 1
            continue
        except TrainingFailedError as error:
            failures += 1
            log(f"{variant}: {str(error).splitlines()[0]}")
            continue
        failures += value.value != stress_patterns.VALUE
        times.append(time.monotonic() - started)
    return hangs, failures, statistics.median(times) if times else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=60, help="launches a row (default 60)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds before a hang")
    args = parser.parse_args(argv)
    print(
        f"gloo teardown, {time.strftime('%Y-%m-%d')}: torch {version_of('torch')}, "
        f"load {load_average()}; {args.runs} runs a row, timeout={args.timeout:g}s",
        flush=True,
    )
    print(f"  {'inside each rank':<52} {'hung':>9} {'failed':>7} {'median s':>9}")
    for label, variant in ROWS.items():
        log(label)
        hangs, failures, median = measure(variant, args.runs, args.timeout)
        line = f"  {label:<52} {hangs:>4} of {args.runs:<3} {failures:>7} {median:>9.3f}"
        print(line, flush=True)
    strays, _ = leftover_processes(5.0)
    others = {p: c for p, c in strays.items() if "sparktrain.node.forkserver" not in c}
    print(f"Leftover processes (idle fork servers not counted): {len(others)}")
    stop_strays(others)
    return 0


if __name__ == "__main__":
    sys.exit(main())
