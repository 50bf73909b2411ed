"""``aggregators.contracts.meta_keys``: every wire key is namespaced, none is NVFlare's own name (docs/design.md,
decision 3)."""

from __future__ import annotations

import pytest
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.app_constant import AlgorithmConstants

from aggregators.contracts import meta_keys


def _wire_keys() -> dict[str, str]:
    """Every public upper-case str constant of the module (the keys it defines), by constant name."""
    return {
        name: value
        for name, value in vars(meta_keys).items()
        if name.isupper() and not name.startswith("_") and isinstance(value, str)
    }


def _nvflare_strings(cls: type) -> set[str]:
    return {value for name, value in vars(cls).items() if name.isupper() and isinstance(value, str)}


def test_the_module_defines_the_documented_keys():
    keys = _wire_keys()
    assert keys["NUM_SAMPLES"] == "train.num_samples"
    documented = {
        "NUM_SAMPLES",
        "NUM_STEPS",
        "TRAIN_LOSS",
        "CLIENT_ALGORITHM",
        "ROUND",
        "NUM_ROUNDS",
        "AGGREGATION_RULE",
    }
    assert documented <= set(keys)


def test_every_key_is_namespaced():
    not_namespaced = {name: value for name, value in _wire_keys().items() if not meta_keys.is_namespaced(value)}
    assert not_namespaced == {}


def test_keys_are_unique():
    values = list(_wire_keys().values())
    assert len(values) == len(set(values))


def test_reserved_list_pins_nvflare_algorithm_constants():
    # NVFlare switches on its own SCAFFOLD/FedProx handlers for these names.
    assert AlgorithmConstants.SCAFFOLD_CTRL_GLOBAL in meta_keys.NVFLARE_RESERVED
    assert AlgorithmConstants.SCAFFOLD_CTRL_DIFF in meta_keys.NVFLARE_RESERVED
    assert AlgorithmConstants.FEDPROX_MU in meta_keys.NVFLARE_RESERVED


def test_no_key_is_an_nvflare_reserved_name():
    reserved = set(meta_keys.NVFLARE_RESERVED) | _nvflare_strings(AlgorithmConstants) | _nvflare_strings(FLMetaKey)
    clashes = {name: value for name, value in _wire_keys().items() if value in reserved}
    assert clashes == {}


def test_no_reserved_name_looks_namespaced():
    # If NVFlare's names were dotted, is_namespaced could not be used to tell ours from theirs.
    for name in meta_keys.NVFLARE_RESERVED:
        assert not meta_keys.is_namespaced(name)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("train.num_samples", True),
        ("scaffold.ctrl.global", True),
        ("a.b", True),
        ("scaffold_c_global", False),
        ("fedprox_mu", False),
        ("plain", False),
        ("", False),
        (".", False),
        (".name", False),
        ("namespace.", False),
    ],
)
def test_is_namespaced(key, expected):
    assert meta_keys.is_namespaced(key) is expected
