"""Make ``import horovod.torch`` give :mod:`sparktrain.horovod.torch` when Horovod is absent.

:func:`install` puts this package and its ``torch`` module in ``sys.modules`` under the names
``horovod`` and ``horovod.torch``, and adds a finder that turns other ``horovod.*`` imports
(``horovod.tensorflow``, ``horovod.spark``, ...) into an ``ImportError`` that says what is
provided. When a real Horovod is importable nothing is changed: it is used as is.

:class:`sparktrain.HorovodRunner` sends the user's function to the ranks as pickled bytes
wrapped in :func:`run_with_alias`, which installs the alias *before* unpickling it: a function
whose module imported ``horovod.torch`` at the top references ``horovod.torch`` by name, and
that name must resolve when the function is unpickled. So the alias travels with the
entrypoint, and neither the worker nor the environment needs to know about Horovod.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import cloudpickle

PROVIDED = ("horovod", "horovod.torch")


class _OtherHorovodModules(importlib.abc.MetaPathFinder):
    """Turn an import of a ``horovod.*`` module we do not provide into a clear error."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("horovod.") or not is_installed():
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: Horovod is not installed, and sparktrain's Horovod "
            "layer provides horovod.torch only (on torch.distributed). Install Horovod, or port "
            "this code to torch.distributed (see sparktrain's docs/migration.md).",
            name=fullname,
        )


def is_installed() -> bool:
    """Whether ``horovod`` in this process is sparktrain's alias."""
    return getattr(sys.modules.get("horovod"), "__name__", None) == "sparktrain.horovod"


def real_horovod() -> str | None:
    """Where a real Horovod package lives, or ``None`` when it is not installed."""
    if is_installed():
        return None
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "horovod"


def install(*, quiet: bool = False) -> bool:
    """Alias ``horovod``/``horovod.torch`` to sparktrain's layer unless Horovod is installed.

    Args:
        quiet: Do not say on stderr which Horovod this process uses.

    Returns:
        ``True`` when ``import horovod.torch`` now gives :mod:`sparktrain.horovod.torch`,
        ``False`` when a real Horovod is installed (and will be used).
    """
    if is_installed():
        return True
    where = real_horovod()
    if where is not None:
        if not quiet:
            print(f"sparktrain: using the installed Horovod ({where})", file=sys.stderr)
        return False
    import sparktrain.horovod
    import sparktrain.horovod.torch

    sys.modules["horovod"] = sparktrain.horovod
    sys.modules["horovod.torch"] = sparktrain.horovod.torch
    if not any(isinstance(f, _OtherHorovodModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _OtherHorovodModules())
    if not quiet:
        print(
            "sparktrain: Horovod is not installed; `import horovod.torch` gives "
            "sparktrain.horovod.torch (torch.distributed: gloo on CPU, NCCL on GPU)",
            file=sys.stderr,
        )
    return True


def run_with_alias(payload: bytes) -> Any:
    """Inside a rank: install the alias, then unpickle ``(main, kwargs)`` and call ``main``."""
    install()
    main, kwargs = cloudpickle.loads(payload)
    return main(**kwargs)
