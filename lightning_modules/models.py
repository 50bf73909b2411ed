"""Plain ``nn.Module`` classifiers used by every federated algorithm in this bundle.

Each model splits into a representation and a classifier so that MOON (which contrasts representations) and any
later personalisation method can reach the representation without knowing the architecture:

* ``features(x)`` returns the flat representation right before the last linear layer, shape ``(batch, feature_dim)``;
* ``head(h)`` maps that representation to logits through the layer named ``classifier``;
* ``forward(x) == head(features(x))``.

MOON (Li, He, Song, CVPR 2021) adds a projection head to the federated model: ``build_model(..., projection_dim=k)``
attaches ``projection`` = Linear(d, d) → ReLU → Linear(d, k) on the representation and replaces ``classifier`` by
Linear(k, num_classes), so that ``head(h) = classifier(projection(h))``: the classifier reads the projection, as in
the authors' ``ModelFedCon``. ``embed(x)`` returns the projected representation z (``features(x)`` without a head).

Every constructor takes keyword arguments with defaults only, so NVFlare can build a model from its import path with
no arguments (``{"path": "lightning_modules.models.LeNet5"}``). Layers are named attributes rather than anonymous
``nn.Sequential`` indices where that is cheap, so the state-dict keys exchanged with the server stay readable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "MLP",
    "MODELS",
    "BatchNormCNN",
    "ClassifierWeights",
    "FeatureClassifier",
    "LeNet5",
    "MaxPool2x2",
    "ProjectionHead",
    "SimpleCNN",
    "build_model",
    "seeded_model",
    "trainable_parameter_names",
]


def _check_positive(name: str, value: int) -> None:
    # bool is an int subclass; True as a layer width is always a configuration mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def quarter_max(x: Tensor) -> Tensor:
    """A 2x2, stride-2 max-pool (no padding, a trailing odd row or column dropped) as the maximum of the four strided
    quarters of ``x``: the values of ``F.max_pool2d(x, 2, 2)`` (a maximum is exact; NaN propagates; of a tie between
    -0.0 and 0.0 either may come back, which no sum or comparison after it can tell apart), without the argmax
    indices that ATen's CPU max-pool computes for a backward pass. Forward only: no gradient routing."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    top = torch.maximum(x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2])
    return torch.maximum(top, torch.maximum(x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]))


class MaxPool2x2(nn.MaxPool2d):
    """``nn.MaxPool2d(2, 2)`` whose forward without autograd on the CPU (scoring, validation, evaluation) is
    `quarter_max`: the same logits bit for bit (tested), about 10x faster than ATen's CPU max-pool at LeNet-5's
    sizes, where that pool took 60 % of a forward pass (64 x 6 x 28 x 28, one thread: 1.5 ms against 0.16 ms).
    With autograd (training), and on other devices, it is ``nn.MaxPool2d`` itself: gradients are unchanged."""

    def __init__(self) -> None:
        super().__init__(kernel_size=2, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or min(x.shape[-2:]) < 2:  # < 2: ATen's refusal
            return super().forward(x)
        return quarter_max(x)


class ProjectionHead(nn.Sequential):
    """MOON's projection head: Linear(d, d) → ReLU → Linear(d, out_dim) (state-dict keys ``0.*`` and ``2.*``)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        _check_positive("projection_dim", out_dim)
        super().__init__(nn.Linear(in_dim, in_dim), nn.ReLU(), nn.Linear(in_dim, out_dim))


class FeatureClassifier(nn.Module):
    """Base class: ``forward(x) = head(features(x))`` with a final linear layer called ``classifier``."""

    feature_dim: int
    classifier: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        # MOON's projection head, part of the federated model when present (see add_projection_head). An instance
        # attribute, not a class one: a class attribute would shadow the registered submodule.
        self.projection: ProjectionHead | None = None

    def features(self, x: Tensor) -> Tensor:
        """Return the flat representation before the classifier, shape ``(batch, feature_dim)``."""
        raise NotImplementedError

    def add_projection_head(self, projection_dim: int) -> None:
        """Attach a projection head of output size ``projection_dim``; the classifier then reads its output."""
        self.projection = ProjectionHead(self.feature_dim, projection_dim)
        self.classifier = nn.Linear(projection_dim, self.classifier.out_features)

    def project(self, h: Tensor) -> Tensor:
        """The representation the classifier reads: ``projection(h)``, or ``h`` itself without a head."""
        return h if self.projection is None else self.projection(h)

    def embed(self, x: Tensor) -> Tensor:
        """z = project(features(x)), the representation MOON contrasts."""
        return self.project(self.features(x))

    def fl_head_keys(self) -> list[str]:
        """The personal head FedRep keeps at the site when the job names none (``--local-keys``): the final
        ``classifier`` layer (lightning_modules/personalization/local_keys.py)."""
        return [f"classifier.{name}" for name in self.classifier.state_dict()]

    def head(self, h: Tensor) -> Tensor:
        """Map a representation from `features` to logits (through the projection head when present)."""
        return self.classifier(self.project(h))

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits for a batch of inputs."""
        return self.head(self.features(x))


class _TwoConvNet(FeatureClassifier):
    """Shared body of LeNet-5 and the NIID-Bench simple CNN: two conv blocks, then fc 120 → fc 84 (ReLU each)."""

    def __init__(self, *, num_classes: int, in_channels: int, conv1_padding: int, flat_side: int) -> None:
        super().__init__()
        _check_positive("num_classes", num_classes)
        _check_positive("in_channels", in_channels)
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5, padding=conv1_padding)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(16 * flat_side * flat_side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.classifier = nn.Linear(84, num_classes)
        self.feature_dim = 84

    def features(self, x: Tensor) -> Tensor:
        """Return the 84-dim representation (after the ReLU of the second fully connected layer)."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = torch.relu(self.fc1(x))
        return torch.relu(self.fc2(x))


class LeNet5(_TwoConvNet):
    """LeNet-5 for ``in_channels x 28 x 28`` inputs (MNIST-like).

    conv 6@5x5 pad 2 → ReLU → max-pool 2 → conv 16@5x5 → ReLU → max-pool 2 → fc 120 → ReLU → fc 84 → ReLU
    | classifier fc ``num_classes``. The padding keeps 28x28 after the first conv, so the flattened map is 16x5x5.
    """

    def __init__(self, *, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels, conv1_padding=2, flat_side=5)


class SimpleCNN(_TwoConvNet):
    """The NIID-Bench "simple CNN" for ``in_channels x 28 x 28`` inputs.

    Same layers as `LeNet5` but with no padding on the first conv (28 → 24 → 12 → 8 → 4), so the flattened
    map is 16x4x4. As in the NIID-Bench code, both hidden fully connected layers are followed by a ReLU.
    """

    def __init__(self, *, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels, conv1_padding=0, flat_side=4)


class BatchNormCNN(FeatureClassifier):
    """A small CNN with BatchNorm for ``in_channels x 28 x 28`` inputs, FedBN's kind of model (``jobs/fedbn``).

    conv 6@5x5 pad 2 → BN → ReLU → max-pool 2 → conv 16@5x5 → BN → ReLU → max-pool 2 → fc 120 → ReLU → fc 84 → ReLU
    | classifier fc ``num_classes``: LeNet-5 with a BatchNorm after each convolution. No BatchNorm after the fully
    connected layers: a 1-d BatchNorm refuses a last batch of one sample, which a site's shard can leave.
    """

    def __init__(self, *, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        _check_positive("num_classes", num_classes)
        _check_positive("in_channels", in_channels)
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5, padding=2)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.classifier = nn.Linear(84, num_classes)
        self.feature_dim = 84

    def features(self, x: Tensor) -> Tensor:
        """Return the 84-dim representation (after the ReLU of the second fully connected layer)."""
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = torch.relu(self.fc1(torch.flatten(x, start_dim=1)))
        return torch.relu(self.fc2(x))


class MLP(FeatureClassifier):
    """Fully connected network for flat inputs (default: the 64-pixel sklearn digits).

    ``hidden_sizes`` Linear+ReLU blocks, then the classifier. Inputs are flattened from dim 1, so ``(B, 1, 8, 8)``
    works as well as ``(B, 64)``. With ``hidden_sizes=()`` the model is multinomial logistic regression and the
    representation is the flattened input.
    """

    def __init__(
        self, *, num_classes: int = 10, in_features: int = 64, hidden_sizes: Sequence[int] = (128, 64)
    ) -> None:
        super().__init__()
        _check_positive("num_classes", num_classes)
        _check_positive("in_features", in_features)
        for width in hidden_sizes:
            _check_positive("hidden_sizes entry", width)
        layers: list[nn.Module] = []
        width_in = in_features
        for width in hidden_sizes:
            layers += [nn.Linear(width_in, width), nn.ReLU()]
            width_in = width
        self.hidden = nn.Sequential(*layers)
        self.classifier = nn.Linear(width_in, num_classes)
        self.feature_dim = width_in

    def features(self, x: Tensor) -> Tensor:
        """Return the output of the last hidden block, shape ``(batch, feature_dim)``."""
        return self.hidden(torch.flatten(x, start_dim=1))


MODELS: dict[str, type[nn.Module]] = {
    "lenet5": LeNet5,
    "simple_cnn": SimpleCNN,
    "mlp": MLP,
    "bn_cnn": BatchNormCNN,
}


def build_model(name: str, projection_dim: int | None = None, **kwargs: object) -> nn.Module:
    """Build the registered model ``name`` with constructor keyword arguments ``kwargs``.

    ``projection_dim`` (MOON) attaches a projection head of that output size; ``None`` builds the plain model.
    """
    try:
        model_cls = MODELS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; valid names: {valid}") from None
    model = model_cls(**kwargs)
    if projection_dim is not None:
        model.add_projection_head(projection_dim)
    return model


def seeded_model(
    name: str, num_classes: int, arch_args: Mapping[str, Any] | None = None, init_seed: int | None = None
) -> nn.Module:
    """`build_model` with its initial weights drawn from ``torch.manual_seed(init_seed)`` inside a forked random
    stream (the caller's stream is left as it was); ``None``: drawn from the caller's stream, as usual. The built-in
    classifier (lightning_modules/classifier.py) and its plain twin on the server (`ClassifierWeights`) both build
    their network here, so a seeded job starts from the same weights on both sides."""
    with torch.random.fork_rng(devices=[]):
        if init_seed is not None:
            torch.manual_seed(init_seed)
        return build_model(name, num_classes=num_classes, **dict(arch_args or {}))


class ClassifierWeights(nn.Module):
    """The built-in classifier's weights without Lightning: its network under ``net``, so the state_dict keys
    (``net.conv1.weight``, ...) and the seeded initial weights are the `FLClassifier`'s. The server holds the global
    model in it (NVFlare's persistor, the test-set evaluator): a server process then never imports Lightning,
    which saves about 3 s of CPU at every start."""

    def __init__(
        self,
        arch: str = "lenet5",
        num_classes: int = 10,
        arch_args: Mapping[str, Any] | None = None,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        self.net = seeded_model(arch, num_classes, arch_args, init_seed)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def trainable_parameter_names(model: nn.Module) -> list[str]:
    """Return the names of parameters with ``requires_grad``, in ``named_parameters`` order.

    Algorithm corrections (control variates, prox and FedDyn terms, server moments) apply to these only; buffers such as
    BatchNorm statistics never appear here because they are not parameters.
    """
    return [name for name, param in model.named_parameters() if param.requires_grad]
