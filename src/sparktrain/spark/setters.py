"""The setters of ``TorchEstimator`` and ``TorchModel``, one per param, as Spark ML stages have.

Each returns the stage, so calls chain: ``estimator.setEpochs(5).setLearningRate(0.01)``.
Values are checked by the stage's ``setParams`` (and again by ``fit`` and ``transform``).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import Self


class TorchSetters:
    """``setX(value)`` for the params both stages have."""

    def setParams(self, **values: Any) -> Self:
        """Set params by name (each stage implements it)."""
        raise NotImplementedError

    def setFeaturesCol(self, value: str) -> Self:
        """The input column (when ``inputCols`` is not set)."""
        return self.setParams(featuresCol=value)

    def setInputCols(self, value: list[str]) -> Self:
        """Several input columns, passed to the model in order."""
        return self.setParams(inputCols=value)

    def setPredictionCol(self, value: str) -> Self:
        """The prediction column the model adds."""
        return self.setParams(predictionCol=value)

    def setProbabilityCol(self, value: str) -> Self:
        """The probability column (classification; "" leaves it out)."""
        return self.setParams(probabilityCol=value)

    def setRawPredictionCol(self, value: str) -> Self:
        """The raw prediction column (classification; "" leaves it out)."""
        return self.setParams(rawPredictionCol=value)

    def setTask(self, value: str) -> Self:
        """classification, binary, regression, raw or auto."""
        return self.setParams(task=value)

    def setUseGpu(self, value: bool | None) -> Self:
        """GPUs (True), the CPU (False), or GPUs where there are some (None)."""
        return self.setParams(useGpu=value)

    def setInferenceBatchSize(self, value: int) -> Self:
        """Rows per forward pass in the fitted model's ``transform``."""
        return self.setParams(inferenceBatchSize=value)


class FitSetters(TorchSetters):
    """``setX(value)`` for the estimator's own params."""

    def setModel(self, value: Any) -> Self:
        """The model, or a function that builds it."""
        return self.setParams(model=value)

    def setLoss(self, value: Any) -> Self:
        """The loss name or function."""
        return self.setParams(loss=value)

    def setOptimizer(self, value: Any) -> Self:
        """The optimizer name, class or function."""
        return self.setParams(optimizer=value)

    def setLearningRate(self, value: float) -> Self:
        """The learning rate of a named optimizer."""
        return self.setParams(learningRate=value)

    def setEpochs(self, value: int) -> Self:
        """Passes over the data."""
        return self.setParams(epochs=value)

    def setBatchSize(self, value: int) -> Self:
        """Rows per batch on each rank."""
        return self.setParams(batchSize=value)

    def setLabelCol(self, value: str) -> Self:
        """The label column."""
        return self.setParams(labelCol=value)

    def setNumProcesses(self, value: int) -> Self:
        """The number of ranks."""
        return self.setParams(numProcesses=value)

    def setLocalMode(self, value: bool) -> Self:
        """Ranks on the driver's machine (True) or as barrier tasks (False)."""
        return self.setParams(localMode=value)

    def setBackend(self, value: str | None) -> Self:
        """'local', 'spark', 'ray', or None (follow localMode)."""
        return self.setParams(backend=value)

    def setStrategy(self, value: str) -> Self:
        """The strategy given to ``prepare_model``."""
        return self.setParams(strategy=value)

    def setShuffle(self, value: bool) -> Self:
        """Shuffle rows each epoch."""
        return self.setParams(shuffle=value)

    def setSeed(self, value: int) -> Self:
        """The seed of the shuffle and of the model's initial weights."""
        return self.setParams(seed=value)

    def setTrainFn(self, value: Any) -> Self:
        """A training function of a ``FitContext`` (None: the built-in loop)."""
        return self.setParams(trainFn=value)

    def setRunOptions(self, value: Any) -> Self:
        """The launch's ``sparktrain.RunOptions``."""
        return self.setParams(runOptions=value)
