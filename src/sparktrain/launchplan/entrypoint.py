"""What each rank runs: a function shipped by value, or a script with arguments.

Functions travel with cloudpickle, so functions, lambdas and closures defined in ``__main__``, a
script or a Jupyter cell work without moving their imports inside them (module globals travel
by reference and are imported in the rank). Pickling happens in the caller, before any process
starts, so an unpicklable closure fails early with the name of the object that would not pickle.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparktrain.contract import pickling
from sparktrain.ground.errors import ConfigError


@dataclass(frozen=True)
class FunctionEntry:
    """A callable with its arguments, pickled.

    Attributes:
        name: The function's qualified name, for messages.
        payload: ``pickling.dumps((fn, args, kwargs))`` (cloudpickle, file names kept).
    """

    name: str
    payload: bytes


@dataclass(frozen=True)
class ScriptEntry:
    """A Python file run as ``__main__`` with ``sys.argv = [path, *args]``, like torchrun.

    Attributes:
        path: Absolute path of the script.
        args: Its command-line arguments, as strings.
    """

    path: str
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        """The script's file name, for messages."""
        return os.path.basename(self.path)


Entrypoint = FunctionEntry | ScriptEntry


def make_entrypoint(
    main: object, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> Entrypoint:
    """Validate ``main`` and its arguments and package them for the ranks.

    Raises:
        ConfigError: ``main`` is neither callable nor an existing file, keyword arguments were
            given with a script, or something in the function or its arguments cannot be pickled.
    """
    kwargs = dict(kwargs or {})
    if isinstance(main, (str, os.PathLike)):
        return _script(main, args, kwargs)
    if not callable(main):
        raise ConfigError(
            f"main={main!r} ({type(main).__name__}) is neither a callable nor a path to a Python "
            "file; pass the training function itself (not its result) or a script path."
        )
    name = getattr(main, "__qualname__", None) or repr(main)
    try:
        payload = pickling.dumps((main, tuple(args), kwargs))
    except Exception as exc:
        culprit = find_unpicklable(main, args, kwargs)
        raise ConfigError(
            f"cannot send {name} to the ranks: {culprit or exc}. Create that object inside the "
            "training function, or pass something picklable (a path, a config) instead."
        ) from exc
    return FunctionEntry(name=name, payload=payload)


def _script(
    main: str | os.PathLike[str], args: Sequence[Any], kwargs: dict[str, Any]
) -> Entrypoint:
    path = Path(main).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"main={os.fspath(main)!r} is not an existing file (looked in {Path.cwd()}); pass a "
            "path to a Python script, or the training function itself."
        )
    if kwargs:
        raise ConfigError(
            f"keyword arguments {sorted(kwargs)} cannot be passed to the script {path.name}: a "
            "script takes command-line arguments only. Pass them positionally, e.g. "
            "run('train.py', '--lr', '0.1')."
        )
    return ScriptEntry(path=str(path.resolve()), args=tuple(str(a) for a in args))


def _pickles(value: object) -> Exception | None:
    try:
        pickling.dumps(value)
    except Exception as exc:
        return exc
    return None


def _named_parts(fn: Callable[..., Any]) -> list[tuple[str, object]]:
    parts: list[tuple[str, object]] = []
    target = inspect.unwrap(fn) if inspect.isfunction(fn) else fn
    if not inspect.isfunction(target):
        return parts
    try:
        found = inspect.getclosurevars(target)
    except (TypeError, ValueError):
        return parts
    qual = target.__qualname__
    parts += [(f"closure variable {k!r} of {qual}", v) for k, v in found.nonlocals.items()]
    parts += [(f"global {k!r} used by {qual}", v) for k, v in found.globals.items()]
    return parts


def find_unpicklable(
    main: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], depth: int = 3
) -> str | None:
    """Name the first object in a function's arguments, closure or globals that will not pickle.

    Returns a description such as ``"closure variable 'lock' of train (lock): cannot pickle
    '_thread.lock' object"``, or ``None`` when no single culprit is found.
    """
    parts: list[tuple[str, object]] = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    parts += _named_parts(main)
    for label, value in parts:
        error = _pickles(value)
        if error is None:
            continue
        if depth > 0 and inspect.isfunction(value):
            inner = find_unpicklable(value, (), {}, depth - 1)
            if inner:
                return f"{label} -> {inner}"
        return f"{label} ({type(value).__name__}): {error}"
    return None
