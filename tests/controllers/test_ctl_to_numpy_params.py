"""``controllers.fedalg_controller.to_numpy_params``: whatever the persistor hands over becomes numpy."""

from __future__ import annotations

import numpy as np
import torch

from controllers.fedalg_controller import to_numpy_params


def test_torch_tensors_and_numpy_arrays_become_numpy_arrays():
    # Prepare
    params = {
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True),  # a live parameter: needs detach()
        "bn.num_batches_tracked": torch.tensor(5, dtype=torch.int64),
        "half": torch.tensor([0.5], dtype=torch.float16),
        "np32": np.array([1.5, -2.5], dtype=np.float32),
        "np_scalar": np.float64(0.25),
        "as_list": [1.0, 2.0],
    }

    # Execute
    converted = to_numpy_params(params)

    # Assert
    assert list(converted) == list(params)
    expected = {
        "w": (np.float32, (2, 2), [[1.0, 2.0], [3.0, 4.0]]),
        "bn.num_batches_tracked": (np.int64, (), 5),
        "half": (np.float16, (1,), [0.5]),
        "np32": (np.float32, (2,), [1.5, -2.5]),
        "np_scalar": (np.float64, (), 0.25),
        "as_list": (np.float64, (2,), [1.0, 2.0]),
    }
    for key, (dtype, shape, values) in expected.items():
        assert isinstance(converted[key], np.ndarray), key
        assert converted[key].dtype == dtype, key
        assert converted[key].shape == shape, key
        np.testing.assert_array_equal(converted[key], values, err_msg=key)


def test_state_dict_of_a_module_converts_key_by_key():
    # Prepare
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()

    # Execute
    converted = to_numpy_params(state)

    # Assert
    assert set(converted) == set(state)
    for key, tensor in state.items():
        np.testing.assert_array_equal(converted[key], tensor.numpy(), err_msg=key)
        assert converted[key].dtype == tensor.numpy().dtype, key


def test_empty_params():
    assert to_numpy_params({}) == {}
