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

    def setValidation(self, value: float | str | None) -> Self:
        """Validation rows: a fraction, or a boolean column."""
        return self.setParams(validation=value)

    def setMetrics(self, value: Any) -> Self:
        """Metric names or functions, per epoch on train and validation."""
        return self.setParams(metrics=value)

    def setCallbacks(self, value: list[Any] | None) -> Self:
        """Functions callback(epoch, record); a true result stops the fit."""
        return self.setParams(callbacks=value)

    def setValBatchSize(self, value: int | None) -> Self:
        """Rows per validation batch (None: batchSize)."""
        return self.setParams(valBatchSize=value)

    def setTrainStepsPerEpoch(self, value: int | None) -> Self:
        """Batches per epoch on each rank (None: all)."""
        return self.setParams(trainStepsPerEpoch=value)

    def setValidationStepsPerEpoch(self, value: int | None) -> Self:
        """Validation batches per epoch on each rank."""
        return self.setParams(validationStepsPerEpoch=value)

    def setWeightCol(self, value: str) -> Self:
        """The sample weight column."""
        return self.setParams(weightCol=value)

    def setLabelCols(self, value: list[str] | None) -> Self:
        """One label column per output of the model."""
        return self.setParams(labelCols=value)

    def setLossWeights(self, value: list[float] | None) -> Self:
        """The weight of each output's loss."""
        return self.setParams(lossWeights=value)

    def setTransformationFn(self, value: Any) -> Self:
        """A function of each batch dict, run in the data reader."""
        return self.setParams(transformationFn=value)

    def setBackwardPassesPerStep(self, value: int) -> Self:
        """Batches accumulated per optimizer step."""
        return self.setParams(backwardPassesPerStep=value)

    def setEarlyStoppingPatience(self, value: int) -> Self:
        """Epochs without improvement before stopping (0: never)."""
        return self.setParams(earlyStoppingPatience=value)

    def setMonitor(self, value: str | None) -> Self:
        """The metric early stopping watches."""
        return self.setParams(monitor=value)

    def setMonitorMode(self, value: str) -> Self:
        """min, max or auto."""
        return self.setParams(monitorMode=value)

    def setMinDelta(self, value: float) -> Self:
        """The smallest change that counts as an improvement."""
        return self.setParams(minDelta=value)

    def setRestoreBestWeights(self, value: bool) -> Self:
        """Return the best epoch's weights after early stopping."""
        return self.setParams(restoreBestWeights=value)

    def setLrSchedule(self, value: Any) -> Self:
        """A schedule name or a function schedule(optimizer)."""
        return self.setParams(lrSchedule=value)

    def setStore(self, value: str | None) -> Self:
        """The folder of the fit's checkpoints."""
        return self.setParams(store=value)

    def setRunId(self, value: str | None) -> Self:
        """The fit's name in the store (a fit with a runId resumes)."""
        return self.setParams(runId=value)

    def setCheckpointEvery(self, value: int) -> Self:
        """Steps between checkpoints inside an epoch (0: epoch ends)."""
        return self.setParams(checkpointEvery=value)
