"""Tests for ``lightning_modules.models``: shapes, the features/head split, hand-counted sizes, and the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_modules.models import (
    MLP,
    MODELS,
    FeatureClassifier,
    LeNet5,
    SimpleCNN,
    build_model,
    trainable_parameter_names,
)


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _conv(c_in: int, c_out: int, k: int) -> int:
    return c_out * c_in * k * k + c_out


# Parameter counts worked out by hand from the layer list, independent of the implementation.
LENET5_PARAMS = _conv(1, 6, 5) + _conv(6, 16, 5) + _linear(16 * 5 * 5, 120) + _linear(120, 84) + _linear(84, 10)
SIMPLE_CNN_PARAMS = _conv(1, 6, 5) + _conv(6, 16, 5) + _linear(16 * 4 * 4, 120) + _linear(120, 84) + _linear(84, 10)
MLP_PARAMS = _linear(64, 128) + _linear(128, 64) + _linear(64, 10)

CASES = [
    pytest.param(LeNet5, (2, 1, 28, 28), 84, id="lenet5"),
    pytest.param(SimpleCNN, (2, 1, 28, 28), 84, id="simple_cnn"),
    pytest.param(MLP, (2, 64), 64, id="mlp"),
]


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_hand_counts_match_the_spelled_out_arithmetic() -> None:
    # conv1 156 + conv2 2416 + fc1 48120 + fc2 10164 + fc3 850; guards the helpers above against a silent typo.
    assert LENET5_PARAMS == 156 + 2416 + 48120 + 10164 + 850 == 61706
    assert SIMPLE_CNN_PARAMS == 156 + 2416 + 30840 + 10164 + 850 == 44426
    assert MLP_PARAMS == 8320 + 8256 + 650 == 17226


@pytest.mark.parametrize(("model_cls", "input_shape", "feature_dim"), CASES)
def test_output_and_feature_shapes(model_cls: type[FeatureClassifier], input_shape: tuple[int, ...], feature_dim: int):
    model = model_cls()
    x = torch.randn(*input_shape)

    assert model(x).shape == (2, 10)
    assert model.features(x).shape == (2, feature_dim)
    assert model.feature_dim == feature_dim


@pytest.mark.parametrize(("model_cls", "input_shape", "feature_dim"), CASES)
def test_forward_equals_head_of_features(model_cls: type[FeatureClassifier], input_shape: tuple[int, ...], feature_dim):
    torch.manual_seed(0)
    model = model_cls().eval()
    x = torch.randn(*input_shape)

    with torch.no_grad():
        assert torch.equal(model(x), model.head(model.features(x)))


@pytest.mark.parametrize(
    ("model_cls", "expected"),
    [(LeNet5, LENET5_PARAMS), (SimpleCNN, SIMPLE_CNN_PARAMS), (MLP, MLP_PARAMS)],
    ids=["lenet5", "simple_cnn", "mlp"],
)
def test_parameter_counts(model_cls: type[nn.Module], expected: int) -> None:
    assert _num_params(model_cls()) == expected


def test_constructor_arguments_change_the_architecture() -> None:
    lenet = LeNet5(num_classes=3, in_channels=3)
    mlp = MLP(num_classes=4, in_features=20, hidden_sizes=(7,))

    assert lenet(torch.randn(2, 3, 28, 28)).shape == (2, 3)
    assert _num_params(lenet) == LENET5_PARAMS - _conv(1, 6, 5) + _conv(3, 6, 5) - _linear(84, 10) + _linear(84, 3)
    assert mlp(torch.randn(2, 20)).shape == (2, 4)
    assert mlp.feature_dim == 7
    assert _num_params(mlp) == _linear(20, 7) + _linear(7, 4)


def test_mlp_flattens_image_shaped_input_and_allows_no_hidden_layer() -> None:
    logistic = MLP(hidden_sizes=())

    assert MLP()(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert logistic.feature_dim == 64
    assert _num_params(logistic) == _linear(64, 10)


def test_features_are_non_negative_after_the_final_relu() -> None:
    # MOON contrasts these representations; the spec puts a ReLU right before the classifier in every model.
    torch.manual_seed(0)
    for model, x in (
        (LeNet5(), torch.randn(4, 1, 28, 28)),
        (SimpleCNN(), torch.randn(4, 1, 28, 28)),
        (MLP(), torch.randn(4, 64)),
    ):
        assert (model.features(x) >= 0).all()


def test_simple_cnn_has_no_padding_and_lenet5_does() -> None:
    assert LeNet5().conv1.padding == (2, 2)
    assert SimpleCNN().conv1.padding == (0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_classes": 0}, {"num_classes": True}, {"in_channels": -1}, {"num_classes": 2.5}],
)
def test_invalid_cnn_arguments_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        LeNet5(**kwargs)


def test_invalid_mlp_hidden_size_raises() -> None:
    with pytest.raises(ValueError, match="hidden_sizes"):
        MLP(hidden_sizes=(128, 0))


def test_registry_names_and_no_arg_construction() -> None:
    assert set(MODELS) == {"lenet5", "simple_cnn", "mlp", "bn_cnn"}
    for name, model_cls in MODELS.items():
        model = build_model(name)
        assert type(model) is model_cls
        assert isinstance(model, FeatureClassifier)


def test_build_model_passes_keyword_arguments() -> None:
    model = build_model("mlp", num_classes=3, hidden_sizes=(5,))

    assert model(torch.randn(2, 64)).shape == (2, 3)


def test_build_model_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'resnet'.*lenet5, mlp, simple_cnn"):
        build_model("resnet")


def test_build_model_forwards_constructor_errors() -> None:
    with pytest.raises(TypeError):
        build_model("lenet5", hidden_sizes=(3,))


def test_trainable_parameter_names_skip_frozen_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)

    names = trainable_parameter_names(model)

    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    assert "1.running_mean" in model.state_dict()  # buffers exist but are excluded


def test_trainable_parameter_names_of_lenet5_in_order() -> None:
    assert trainable_parameter_names(LeNet5()) == [
        f"{layer}.{kind}" for layer in ("conv1", "conv2", "fc1", "fc2", "classifier") for kind in ("weight", "bias")
    ]


# -- the max-pool of forward passes without autograd ------------------------------------------------------------------
def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and NaN where NaN (-0.0 == 0.0: a tie between the two zeros may return either)."""
    nan = torch.isnan(a)
    return a.shape == b.shape and torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("shape", [(3, 6, 28, 28), (2, 16, 10, 10), (2, 3, 7, 9), (5, 1, 3, 2)])
def test_the_quarter_maximum_is_the_max_pool_bit_for_bit_on_hostile_input(shape: tuple[int, ...]) -> None:
    from lightning_modules.models import quarter_max

    g = torch.Generator().manual_seed(sum(shape))
    # Ties everywhere (small integers, both signed zeros), infinities and NaNs; odd sides drop the last row/column;
    # the layouts of a convolution's output (contiguous, channels-last) and a transposed view.
    x = torch.randint(-2, 3, shape, generator=g).float()
    x[torch.rand(shape, generator=g) < 0.2] = -0.0
    x[torch.rand(shape, generator=g) < 0.05] = float("inf")
    x[torch.rand(shape, generator=g) < 0.05] = float("-inf")
    x[torch.rand(shape, generator=g) < 0.05] = float("nan")
    expected = torch.nn.functional.max_pool2d(x, 2, 2)
    for layout in (
        x,
        x.contiguous(memory_format=torch.channels_last),
        x.transpose(-1, -2).contiguous().transpose(-1, -2),
    ):
        assert _same_values(quarter_max(layout), expected)


def test_the_pool_refuses_a_map_smaller_than_its_window_with_and_without_autograd() -> None:
    from lightning_modules.models import MaxPool2x2

    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="Output size is too small"):
            MaxPool2x2()(torch.zeros(2, 3, 1, 5))


@pytest.mark.parametrize("name", ["lenet5", "simple_cnn", "bn_cnn"])
def test_scoring_forwards_skip_the_indexed_max_pool_and_training_keeps_it(name: str, monkeypatch) -> None:
    # Without autograd (scoring, validation, evaluation) the CNNs pool by `quarter_max`: the same logits bit for bit
    # as the indexed max-pool (ties and zeros everywhere after the ReLUs); with autograd they use the indexed max-pool,
    # so training's gradients are unchanged.
    model = build_model(name).eval()
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    reference = build_model(name).eval()
    reference.load_state_dict(model.state_dict())
    reference.pool = nn.MaxPool2d(kernel_size=2, stride=2)
    with torch.no_grad():
        expected = reference(x)
    calls: list[bool] = []
    indexed = torch.nn.functional.max_pool2d

    def spy(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return indexed(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "max_pool2d", spy)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    assert calls == []
    model(x).sum().backward()
    reference(x).sum().backward()
    assert calls == [True, True, True, True]
    for (key, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), key
