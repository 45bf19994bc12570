"""Entrypoints: what can be shipped to the ranks, and clear errors for what cannot."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sparktrain import ConfigError
from sparktrain.launchplan.entrypoint import FunctionEntry, ScriptEntry, make_entrypoint


def test_function_entry() -> None:
    entry = make_entrypoint(lambda x: x + 1, (1,), {})
    assert isinstance(entry, FunctionEntry)
    assert entry.name == "test_function_entry.<locals>.<lambda>"


def test_script_entry_stringifies_args(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    entry = make_entrypoint(str(script), (1, 0.5, "--x"))
    assert entry == ScriptEntry(path=str(script), args=("1", "0.5", "--x"))


def test_missing_script(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"main='nope\.py' is not an existing file"):
        make_entrypoint("nope.py")


def test_kwargs_with_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=r"keyword arguments \['lr'\] cannot be passed"):
        make_entrypoint(script, (), {"lr": 0.1})


def test_not_callable() -> None:
    with pytest.raises(ConfigError, match=r"main=42 \(int\) is neither a callable"):
        make_entrypoint(42)


def test_unpicklable_closure_names_the_object() -> None:
    lock = threading.Lock()

    def train() -> None:
        with lock:
            pass

    with pytest.raises(ConfigError, match=r"closure variable 'lock' of .*train \(lock\)"):
        make_entrypoint(train)


def test_unpicklable_argument_names_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"keyword argument 'guard' \(lock\)"):
        make_entrypoint(print, (), {"guard": threading.Lock()})
