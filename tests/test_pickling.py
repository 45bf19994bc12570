"""Functions sent by value keep their file name (cloudpickle 3.1.3 replaced it with a dummy), and
one that reads ``.config`` beside ``import torch.distributed`` can be sent at all."""

from __future__ import annotations

import pickle
import sys
import traceback
import types

from sparktrain.contract import pickling

SOURCE = """
def helper(x):
    return 1 / x

def entry():
    inner = lambda: helper(0)
    return inner()
"""


def test_code_sent_by_value_keeps_its_file_and_lines() -> None:
    module = types.ModuleType("users_notebook_cell")  # not in sys.modules: goes by value
    exec(compile(SOURCE, "/home/me/train.py", "exec"), module.__dict__)
    assert "users_notebook_cell" not in sys.modules
    entry = pickle.loads(pickling.dumps(module.entry))
    assert entry is not module.entry
    try:
        entry()
    except ZeroDivisionError as exc:
        frames = traceback.extract_tb(exc.__traceback__)[1:]
    assert [(f.filename, f.lineno, f.name) for f in frames] == [
        ("/home/me/train.py", 7, "entry"),
        ("/home/me/train.py", 6, "<lambda>"),
        ("/home/me/train.py", 3, "helper"),
    ]


USES_CONFIG = """
import torch

def entry(model):
    import torch.distributed as dist
    return torch.tensor([1.0]), model.config, dist.is_available()
"""


def test_a_function_reading_config_beside_torch_distributed_is_sent() -> None:
    """cloudpickle adds ``torch.distributed.config`` (a module subclass) to what it sends."""
    from torch.distributed import config

    assert type(config) is not types.ModuleType  # torch's config modules are a subclass
    module = types.ModuleType("users_notebook_cell")
    exec(compile(USES_CONFIG, "/home/me/train.py", "exec"), module.__dict__)
    entry = pickle.loads(pickling.dumps(module.entry))
    model = types.SimpleNamespace(config={"hidden": 8})
    value, seen, available = entry(model)
    assert float(value[0]) == 1.0 and seen == {"hidden": 8} and available is True
