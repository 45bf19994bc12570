"""The backends by name: the one place that names them, and the only one that imports them.

A front door takes ``backend=`` as a name of :data:`BackendName` or a
:class:`~sparktrain.backends.base.Backend` object. :func:`make_backend` turns a name into an
object: it imports the wing's module only then (pyspark and Ray are optional), and makes the
backend with :meth:`Backend.open`. :func:`backend_class` gives the class without making one, for
what a front door asks before anything starts (:attr:`Backend.on_this_machine`, ...).

A new backend is a folder of :mod:`sparktrain.backends` (its driver side, and its ``node/``
side where its nodes run away from the caller) plus one line in :data:`BACKENDS`; a backend
outside sparktrain adds its line at run time with :func:`register`. docs/architecture.md, "A new
backend", walks through one.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Literal, get_args

from sparktrain.backends.base import Backend, Wanted
from sparktrain.ground.errors import ConfigError

#: The names of sparktrain's own backends, as front doors' signatures take them.
BackendName = Literal["local", "spark", "ray"]

#: Each backend's name -> ``"module:Class"`` of its :class:`Backend`, imported on use.
BACKENDS: dict[str, str] = {
    "local": "sparktrain.backends.local.backend:LocalBackend",
    "spark": "sparktrain.backends.spark.backend:SparkBackend",
    "ray": "sparktrain.backends.ray.backend:RayBackend",
}


def names() -> tuple[str, ...]:
    """Every backend name known now, sorted (sparktrain's and those :func:`register` added)."""
    return tuple(sorted(BACKENDS))


def register(name: str, target: str) -> None:
    """Add the backend ``name``, whose class ``target`` names as ``"module:Class"``.

    The module is imported when a launch first names the backend.

    Raises:
        ConfigError: ``name`` is taken, or ``target`` is not ``"module:Class"``.
    """
    if not isinstance(name, str) or not name or name in BACKENDS:
        raise ConfigError(
            f"register({name!r}, ...): a backend's name must be a new, non-empty string; taken: "
            f"{', '.join(names())}."
        )
    module, _, attr = target.partition(":")
    if not module or not attr.isidentifier():
        raise ConfigError(f"register({name!r}, {target!r}): name the class as 'module:Class'.")
    BACKENDS[name] = target


def unregister(name: str) -> None:
    """Remove a backend :func:`register` added (sparktrain's own stay)."""
    if name in get_args(BackendName):
        raise ConfigError(f"unregister({name!r}): sparktrain's own backends stay registered.")
    BACKENDS.pop(name, None)


def check_backend(backend: object) -> None:
    """Refuse a ``backend`` that is neither a known name nor a :class:`Backend`.

    Raises:
        ConfigError: Names the value, the closest known name, and every known one.
    """
    if isinstance(backend, Backend) or (isinstance(backend, str) and backend in BACKENDS):
        return
    close = difflib.get_close_matches(str(backend), BACKENDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise ConfigError(
        f"backend={backend!r} is not one of: {', '.join(names())} (or a "
        f"sparktrain.backends.base.Backend){hint}"
    )


def for_local_mode(
    local_mode: bool, backend: BackendName | Backend | None = None
) -> BackendName | Backend:
    """The backend of pyspark's ``local_mode``: ``backend`` if given, else this machine or Spark."""
    if backend is not None:
        return backend
    return "local" if local_mode else "spark"


def backend_class(backend: object) -> type[Backend]:
    """The class of ``backend`` (a name, imported now, or an object), without making one.

    Raises:
        ConfigError: An unknown name.
    """
    if isinstance(backend, Backend):
        return type(backend)
    check_backend(backend)
    module, _, attr = BACKENDS[str(backend)].partition(":")
    found = getattr(importlib.import_module(module), attr)
    if not (isinstance(found, type) and issubclass(found, Backend)):
        raise ConfigError(f"backend {backend!r}: {BACKENDS[str(backend)]} is not a Backend.")
    return found


def make_backend(backend: object, wanted: Wanted | None = None) -> Backend:
    """The backend named ``backend`` (or ``backend`` itself, an object), for ``wanted``.

    Raises:
        ConfigError: An unknown name (the message lists the known ones), or what the chosen
            backend needs is missing (pyspark, an active SparkSession, Ray).
    """
    if isinstance(backend, Backend):
        return backend
    return backend_class(backend).open(wanted or Wanted())
