"""Server-side evaluation of the global model on the dataset's published test split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from data_prep import load_dataset
from lightning_modules.evaluation import evaluate_classifier
from lightning_modules.models import ClassifierWeights


class TestSetEvaluator:
    """Builds the clients' network (`ClassifierWeights`: the `FLClassifier`'s state_dict keys, without Lightning)
    and scores global parameters on the test split.

    ``max_test_samples`` keeps the first n test samples (the published order) for quick runs; ``None`` uses all.
    The data is loaded on first use so that building the job does not need it.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        arch: str = "lenet5",
        num_classes: int = 10,
        arch_args: dict[str, Any] | None = None,
        dataset: str = "fashion_mnist",
        data_dir: str | None = None,
        max_test_samples: int | None = None,
        batch_size: int = 1000,
    ) -> None:
        self.arch = arch
        self.num_classes = num_classes
        self.arch_args = arch_args
        self.dataset = dataset
        self.data_dir = data_dir
        self.max_test_samples = max_test_samples
        self.batch_size = batch_size
        self._always_serialize_args = ("arch", "num_classes", "dataset", "max_test_samples")
        self._model: ClassifierWeights | None = None
        self._data: tuple[np.ndarray, np.ndarray] | None = None

    def evaluate(self, params: Mapping[str, Any]) -> dict[str, float]:
        model = self._get_model()
        model.load_state_dict({key: torch.as_tensor(np.asarray(value)) for key, value in params.items()})
        x, y = self._get_data()
        return evaluate_classifier(model.net, x, y, self.num_classes, self.batch_size)

    def _get_model(self) -> ClassifierWeights:
        if self._model is None:
            self._model = ClassifierWeights(arch=self.arch, num_classes=self.num_classes, arch_args=self.arch_args)
        return self._model

    def _get_data(self) -> tuple[np.ndarray, np.ndarray]:
        if self._data is None:
            data = load_dataset(self.dataset, self.data_dir)
            limit = self.max_test_samples or len(data.test_y)
            self._data = (data.test_x[:limit], data.test_y[:limit])
        return self._data
