"""Inside the ranks of ``DeepspeedTorchDistributor``: the DeepSpeed configuration made visible.

A function gets it from ``sparktrain.deepspeed_config()`` (and the ZeRO strategies of
``prepare_model`` merge it into their own); a script gets ``--deepspeed --deepspeed_config
PATH``, a private file each rank writes before running the script and removes after.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparktrain.rank import rundirs


def run_with_config(config: dict[str, Any], main: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Inside a rank: make ``config`` visible to ``sparktrain.deepspeed_config()``, run ``main``."""
    from sparktrain.strategies import zero  # torch: loaded in the rank, not by the front door

    zero.set_config(config)
    return main(*args, **kw)


def run_script_with_config(config: dict[str, Any], script: str, args: list[str]) -> None:
    """Inside a rank: write ``config`` to a private file; run ``script`` with DeepSpeed flags."""
    folder = rundirs.make("deepspeed")
    try:
        path = os.path.join(folder, "ds_config.json")
        Path(path).write_text(json.dumps(config))
        sys.argv = [script, *args, "--deepspeed", "--deepspeed_config", path]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
