"""A caller in a process of its own, for ``chaos.py``'s caller-kill fault.

    python benchmarks/chaos_caller.py WORKLOAD FOLDER CKPT DATA_DIR

Launches the workload as ``chaos.py`` does (no restarts) and, if nobody kills it first, writes
``FOLDER/result.json``: every rank's value, or the error's first line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from chaos_runner import spec


def main(argv: Sequence[str]) -> int:
    from sparktrain import TrainingFailedError, launch

    workload, folder, ckpt, data_dir = argv
    fn, args, options = spec(workload, Path(folder), Path(ckpt), data_dir)
    try:
        result = launch(fn, args, **options)
    except TrainingFailedError as error:
        first = str(error).splitlines()[0] if str(error) else ""
        found: dict[str, object] = {"error": f"{type(error).__name__}: {first}"}
    else:
        found = {"values": {str(rank): v for rank, v in result.return_values.items()}}
    Path(folder, "result.json").write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
