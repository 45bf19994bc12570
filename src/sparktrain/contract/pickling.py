"""Pickle what the ranks run, keeping the file names of functions sent by value.

cloudpickle sends a function defined in ``__main__``, a notebook cell or a module registered with
``register_pickle_by_value`` as its code object. From cloudpickle 3.1.3 on, that code object
arrives with its file name replaced by ``"<dynamic-code>"`` (to make payloads deterministic).
A rank's traceback then says ``File "<dynamic-code>", line 12`` with no source line, and a hung
rank's stack shows no user frame at all. :func:`dumps` is cloudpickle with one change: code
objects keep their file name, and modules of a subclass of their own (torch's config modules) go
by name like plain modules. Everything else (what goes by value, by reference) is cloudpickle's.
"""

from __future__ import annotations

import importlib
import io
import sys
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any, ClassVar

import cloudpickle

_BASE: Any = cloudpickle.Pickler.dispatch_table


def named_code(make: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str) -> Any:
    """Rebuild a code object as cloudpickle does, then give it back its file name."""
    code = make(*args)
    return code.replace(co_filename=filename) if code.co_filename != filename else code


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    make, args = _BASE[types.CodeType](code)[:2]
    return named_code, (make, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    dispatch_table: ClassVar[ChainMap[type, Any]] = ChainMap({types.CodeType: _reduce_code}, _BASE)

    def reducer_override(self, obj: Any) -> Any:
        """A module of a subclass of its own goes by name, as a plain module does.

        torch makes its config modules (``torch.distributed.config``...) such objects, and
        cloudpickle sends with a function every imported submodule whose name's parts all
        appear in its code (``import torch.distributed`` and ``model.config`` are enough);
        its own rule takes plain modules only, and the config module could not be pickled.
        """
        if (
            isinstance(obj, types.ModuleType)
            and type(obj) is not types.ModuleType
            and sys.modules.get(obj.__name__) is obj
        ):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj: object) -> bytes:
    """``cloudpickle.dumps(obj)``, with the file names of functions sent by value kept."""
    with io.BytesIO() as out:
        _Pickler(out, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return out.getvalue()
