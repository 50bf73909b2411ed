"""Simulated attacks (lightning_modules/attacks.py): each attack on closed-form inputs, the site choice, and the
Lightning callback that alters the weights NVFlare sends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.attack_callback import AttackCallback
from lightning_modules.attacks import (
    AttackConfig,
    attack_script_args,
    attack_update,
    choose_malicious_sites,
    flip_labels,
    resolve_malicious_sites,
    site_labels,
)

DELTA = {"w": torch.tensor([1.0, -2.0, 0.5])}


def test_sign_flip_and_scale_closed_form() -> None:
    gen = torch.Generator().manual_seed(0)
    torch.testing.assert_close(attack_update("sign_flip", DELTA, 4.0, gen)["w"], torch.tensor([-4.0, 8.0, -2.0]))
    torch.testing.assert_close(attack_update("scale", DELTA, 10.0, gen)["w"], torch.tensor([10.0, -20.0, 5.0]))


def test_gaussian_adds_seeded_noise_of_the_given_std() -> None:
    out = attack_update("gaussian", DELTA, 0.3, torch.Generator().manual_seed(7))["w"]
    noise = torch.randn(3, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out, DELTA["w"] + 0.3 * noise)
    big = attack_update("gaussian", {"w": torch.zeros(20000)}, 0.3, torch.Generator().manual_seed(1))["w"]
    assert big.std().item() == pytest.approx(0.3, rel=0.03)


def test_label_flip_maps_c_to_nine_minus_c_only_for_active_sites() -> None:
    labels = np.array([0, 1, 9, 4])
    np.testing.assert_array_equal(flip_labels(labels, 10), [9, 8, 0, 5])
    config = AttackConfig("label_flip", malicious_sites=("site-2",), start_round=2)
    assert site_labels(labels, config, "site-2", 1) is labels  # before the start round
    np.testing.assert_array_equal(site_labels(labels, config, "site-2", 2), [9, 8, 0, 5])
    assert site_labels(labels, config, "site-1", 5) is labels


def test_unknown_attack_and_update_attack_names() -> None:
    with pytest.raises(ValueError, match="unknown attack"):
        AttackConfig("backdoor")
    with pytest.raises(ValueError, match="not an update attack"):
        attack_update("label_flip", DELTA, 1.0, torch.Generator())


def test_malicious_share_is_seeded_and_rounded_half_up() -> None:
    chosen = choose_malicious_sites(10, 0.2, seed=0)
    assert len(chosen) == 2 and chosen == choose_malicious_sites(10, 0.2, seed=0)
    assert len(choose_malicious_sites(10, 0.25, seed=0)) == 3  # 2.5 -> 3, not Python's round-half-even 2
    assert resolve_malicious_sites(10, 0.4, "site-7,site-2", 0) == ("site-2", "site-7")
    with pytest.raises(ValueError, match="site-11"):
        resolve_malicious_sites(10, 0.0, "site-11", 0)


def test_script_args_are_empty_without_an_attack() -> None:
    assert attack_script_args("none", None, 0, (), 3) == []
    assert attack_script_args("scale", 5.0, 2, ("site-1",), 3) == [
        "--attack scale",
        "--attack-start-round 2",
        "--malicious-sites site-1",
        "--attack-strength 5.0",
    ]
    with pytest.raises(ValueError, match="needs malicious sites"):
        attack_script_args("scale", None, 0, (), 3)


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("count", torch.tensor(3))


def _run_round(config: AttackConfig, site: str, round_num: int) -> tuple[_Module, dict]:
    module = _Module()
    with torch.no_grad():
        module.lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
        module.lin.bias.fill_(0.5)
    callback = AttackCallback(config, site, site_index=0)
    callback.round_num = round_num
    callback.on_train_start(None, module)
    callback.on_train_epoch_start(None, module)  # snapshot of the "global" weights
    with torch.no_grad():  # local training moved the weights by +1
        module.lin.weight.add_(1.0)
        module.lin.bias.add_(1.0)
    module.__fl_meta__ = {"train.num_samples": 5}
    callback.on_train_end(None, module)
    return module, module.__fl_meta__


def test_callback_sends_x_plus_attacked_delta_and_reports_it() -> None:
    module, meta = _run_round(AttackConfig("sign_flip", ("site-1",), strength=4.0), "site-1", 0)
    torch.testing.assert_close(module.lin.weight, torch.tensor([[1.0 - 4.0, 2.0 - 4.0]]))
    torch.testing.assert_close(module.lin.bias, torch.tensor([0.5 - 4.0]))
    assert module.count.item() == 3  # buffers untouched
    assert meta[meta_keys.ATTACK_APPLIED] is True and meta[meta_keys.ATTACK_NAME] == "sign_flip"


def test_callback_leaves_benign_sites_and_early_rounds_alone() -> None:
    config = AttackConfig("scale", ("site-2",), start_round=1)
    for site, round_num in (("site-1", 3), ("site-2", 0)):
        module, meta = _run_round(config, site, round_num)
        torch.testing.assert_close(module.lin.weight, torch.tensor([[2.0, 3.0]]))
        assert meta[meta_keys.ATTACK_APPLIED] is False
    _, meta = _run_round(AttackConfig(), "site-1", 0)
    assert meta == {"train.num_samples": 5}  # no attack configured: the meta is exactly as before
