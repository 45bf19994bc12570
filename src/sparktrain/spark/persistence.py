"""ML persistence of ``TorchEstimator`` and ``TorchModel``: ``write().save(path)``, ``load(path)``.

A saved stage is a folder with two parts, both written through Spark so that any file system
Spark writes to works (local, HDFS, DBFS, S3, ABFS) and Spark Connect too:

- ``metadata/``: Spark ML's own JSON (class, uid, Spark version, params), the format
  ``DefaultParamsWriter`` writes, so that ``Pipeline`` and ``PipelineModel`` persistence find
  the stage and its plain params;
- ``data/``: the Python objects (the torch model, a loss or optimizer function, the run
  options) pickled with cloudpickle, in rows of at most :data:`CHUNK` bytes.

Loading unpickles them: load only what you trust, as with ``torch.load``. A model's class must be
importable where it is loaded, unless it was defined in the notebook (cloudpickle then carries
it by value).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWriter,
)

from sparktrain.ground.errors import ConfigError
from sparktrain.ground.version import __version__
from sparktrain.spark.params import OBJECT_PARAMS

#: Bytes per row of a stage's pickled objects.
CHUNK = 16 * 1024 * 1024

T = TypeVar("T", bound=MLReadable[Any])


def _session(given: Any) -> Any:
    if given is not None:
        return given
    from sparktrain.backends.spark.session import active_session

    return active_session()


def _is_connect(session: Any) -> bool:
    from sparktrain.backends.spark.session import is_connect

    return is_connect(session)


def write_objects(session: Any, path: str, value: Any, mode: str) -> None:
    """Pickle ``value`` into ``path`` as rows of at most :data:`CHUNK` bytes."""
    from sparktrain.contract import pickling

    try:
        data = pickling.dumps(value)
    except Exception as exc:
        raise ConfigError(f"the stage's objects cannot be pickled for saving: {exc}") from exc
    rows = [(i, data[at : at + CHUNK]) for i, at in enumerate(range(0, len(data), CHUNK))]
    frame = session.createDataFrame(rows, "index int, bytes binary")
    frame.coalesce(1).write.mode(mode).parquet(path)


def read_objects(session: Any, path: str) -> Any:
    """What :func:`write_objects` wrote."""
    import cloudpickle

    rows = session.read.parquet(path).orderBy("index").collect()
    return cloudpickle.loads(b"".join(bytes(row["bytes"]) for row in rows))


class StageWriter(MLWriter):
    """Writes a stage's metadata and its pickled objects (module doc)."""

    def __init__(self, instance: Any, objects: Callable[[], dict[str, Any]]) -> None:
        """Write ``instance``; ``objects()`` gives what goes to ``data/``."""
        super().__init__()
        self.instance = instance
        self.objects = objects

    def save(self, path: str) -> None:
        """Save to ``path`` (refused if it exists, unless ``overwrite()`` was called)."""
        session = _session(self._sparkSession)
        if self.shouldOverwrite and not _is_connect(session):
            self._sparkSession = session
            self._handleOverwrite(path)  # Spark's own: removes the old folder first
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:
        """Write ``metadata/`` and ``data/`` under ``path``."""
        session = _session(self._sparkSession)
        mode = "overwrite" if self.shouldOverwrite else "error"
        instance = self.instance
        plain = {
            p.name: value for p, value in instance._paramMap.items() if p.name not in OBJECT_PARAMS
        }
        metadata = DefaultParamsWriter._get_metadata_to_save(
            instance, session, {"sparktrainVersion": __version__}, plain
        )
        frame = session.createDataFrame([(metadata,)], "value string")
        frame.coalesce(1).write.mode(mode).text(os.path.join(path, "metadata"))
        write_objects(session, os.path.join(path, "data"), self.objects(), mode)


class StageReader(MLReader[T], Generic[T]):
    """Reads what :class:`StageWriter` wrote into a new instance of ``cls``."""

    def __init__(self, cls: type[T], restore: Callable[[T, dict[str, Any]], None]) -> None:
        """Make ``cls()`` instances; ``restore(instance, objects)`` puts the objects back."""
        super().__init__()
        self.cls = cls
        self.restore = restore

    def load(self, path: str) -> T:
        """Load the stage saved at ``path``."""
        session = _session(self._sparkSession)
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        metadata = DefaultParamsReader.loadMetadata(path, session)
        if metadata["class"] != expected:
            raise ConfigError(
                f"{path} holds a {metadata['class']}, not a {expected}; load it with that class "
                "(or with PipelineModel.load for a pipeline)."
            )
        instance = self.cls()
        instance._resetUid(metadata["uid"])  # type: ignore[attr-defined]
        DefaultParamsReader.getAndSetParams(instance, metadata)
        self.restore(instance, read_objects(session, os.path.join(path, "data")))
        return instance
