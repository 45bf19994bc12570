"""Make ``import horovod.torch`` give :mod:`sparktrain.horovod.torch` when Horovod is absent.

:func:`install` puts a ``horovod`` package and :mod:`sparktrain.horovod.torch` in
``sys.modules`` under the names ``horovod`` and ``horovod.torch``, and adds a finder that turns
other ``horovod.*`` imports (``horovod.tensorflow``, ``horovod.spark``, ...) into an
``ImportError`` that says what is provided. When a real Horovod is importable nothing is
changed: it is used as is.

:class:`sparktrain.HorovodRunner` and ``horovod.run`` send the user's function to the ranks as
pickled bytes wrapped in :func:`run_with_alias`, which installs the alias *before* unpickling
it: a function whose module imported ``horovod.torch`` at the top references ``horovod.torch``
by name, and that name must resolve when the function is unpickled.

In every other rank (a script run by ``sparktrain run``, a ``TorchDistributor`` function), the
worker adds :class:`AliasWhenAbsent` at the *end* of ``sys.meta_path``: it is asked only when no
other finder found ``horovod``, that is when Horovod is not installed, and then installs the
alias. A rank that never imports ``horovod`` pays nothing.

The ``horovod`` a rank gets is made here (:func:`rank_package`): ``horovod.torch``, ``install``,
and a ``run`` that refuses, since ``horovod.run`` starts ranks from the caller's process. The
caller's own ``horovod`` is the front door :mod:`sparktrain.horovod`, which passes itself to
:func:`install`.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import cloudpickle

from sparktrain.ground.errors import ConfigError

PROVIDED = ("horovod", "horovod.torch")


class _ByName(importlib.abc.MetaPathFinder):
    """A finder that decides by the module's name alone (the path and the target do not count)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``fullname`` from :meth:`spec`."""
        return self.spec(fullname)

    @abc.abstractmethod
    def spec(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        """A spec for ``fullname``, or ``None`` to let the next finder look."""


class _OtherHorovodModules(_ByName):
    """Turn an import of a ``horovod.*`` module we do not provide into a clear error."""

    def spec(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        """Raise ``ModuleNotFoundError`` for a ``horovod.*`` module while the alias is in use."""
        if not fullname.startswith("horovod.") or not is_installed():
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: Horovod is not installed, and sparktrain's Horovod "
            "layer provides horovod.torch only (on torch.distributed). Install Horovod, or port "
            "this code to torch.distributed (see sparktrain's docs/migration.md).",
            name=fullname,
        )


#: The attribute that marks a ``horovod`` module as sparktrain's alias.
MARK = "__sparktrain_alias__"


def is_installed() -> bool:
    """Whether ``horovod`` in this process is sparktrain's alias."""
    return bool(getattr(sys.modules.get("horovod"), MARK, False))


_probing = False  # True while real_horovod() looks: AliasWhenAbsent then finds nothing


def real_horovod() -> str | None:
    """Where a real Horovod package lives, or ``None`` when it is not installed."""
    global _probing  # noqa: PLW0603 - one flag per process, set around one lookup
    if is_installed():
        return None
    _probing = True
    try:
        spec = importlib.util.find_spec("horovod")
    finally:
        _probing = False
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "horovod"


def install(*, quiet: bool = False, top: ModuleType | None = None) -> bool:
    """Alias ``horovod``/``horovod.torch`` to sparktrain's layer unless Horovod is installed.

    Args:
        quiet: Do not say on stderr which Horovod this process uses.
        top: The module ``import horovod`` gives: the caller's front door
            (:mod:`sparktrain.horovod`, passed by its ``install``), or by default a rank's own
            (:func:`rank_package`).

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
    sys.modules["horovod"] = _alias(quiet, top)
    return True


def _alias(quiet: bool, top: ModuleType | None = None) -> ModuleType:
    """Put ``horovod.torch`` (and the finder for other ``horovod.*``) in place; the package."""
    import sparktrain.horovod.torch

    top = top if top is not None else rank_package()
    setattr(top, MARK, True)
    sys.modules["horovod.torch"] = sparktrain.horovod.torch
    if not any(isinstance(f, _OtherHorovodModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _OtherHorovodModules())
    if not quiet:
        print(
            "sparktrain: Horovod is not installed; `import horovod.torch` gives "
            "sparktrain.horovod.torch (torch.distributed: gloo on CPU, NCCL on GPU)",
            file=sys.stderr,
        )
    return top


def rank_package() -> ModuleType:
    """The ``horovod`` package of a rank: ``horovod.torch``, :func:`install` and :func:`run`.

    Made here rather than taken from :mod:`sparktrain.horovod`, the caller's front door, which a
    rank never loads.
    """
    import sparktrain.horovod.torch

    package = ModuleType("horovod", "sparktrain's horovod in a rank (torch.distributed).")
    package.__path__ = []  # a package: `import horovod.torch` looks in sys.modules first
    package.torch = sparktrain.horovod.torch  # type: ignore[attr-defined]
    package.install = install  # type: ignore[attr-defined]
    package.run = run  # type: ignore[attr-defined]
    return package


def run(*args: Any, **kwargs: Any) -> Any:
    """``horovod.run`` inside a rank: refused, since it starts ranks from the caller's process.

    Raises:
        ConfigError: Always; the message says to call the function directly in the rank.
    """
    raise ConfigError(
        "horovod.run(...) starts ranks from the caller's process; this process is already a rank "
        "of a run, where it would start a run inside the run. Call the function directly here "
        "(Horovod's examples do when --num-proc is not given), or call horovod.run on the driver."
    )


class AliasWhenAbsent(_ByName, importlib.abc.Loader):
    """Last on ``sys.meta_path``: ``import horovod`` gives the alias when nothing else found it."""

    def spec(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        """A spec for ``horovod`` (every finder before this one missed it), else ``None``."""
        if fullname != "horovod" or _probing:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The alias: a rank's ``horovod`` package, with ``horovod.torch`` in place."""
        return _alias(quiet=False)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the package is whole."""


def add_finder() -> None:
    """Put :class:`AliasWhenAbsent` at the end of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, AliasWhenAbsent) for f in sys.meta_path):
        sys.meta_path.append(AliasWhenAbsent())


def run_with_alias(payload: bytes) -> Any:
    """Inside a rank: install the alias, unpickle ``(main, args, kwargs)``, call ``main``."""
    install()
    main, args, kwargs = cloudpickle.loads(payload)
    return main(*args, **kwargs)
