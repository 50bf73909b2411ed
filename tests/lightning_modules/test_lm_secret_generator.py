"""The secret generator works where torch's generators cannot be weakly referenced (torch 2.11, the GPU machine's
build: DP-SGD failed there with ``TypeError: cannot create weak reference to 'torch._C.Generator' object``), and a
generator with the same seed made by anyone else is still not secret."""

from __future__ import annotations

import _weakrefset
import weakref

import pytest
import torch

from lightning_modules.privacy import secret


def test_secret_generators_need_no_weak_reference(monkeypatch):
    real_ref = weakref.ref

    def no_generator_refs(item, *args):
        if isinstance(item, torch.Generator):
            raise TypeError("cannot create weak reference to 'torch._C.Generator' object")
        return real_ref(item, *args)

    monkeypatch.setattr(weakref, "ref", no_generator_refs)
    monkeypatch.setattr(_weakrefset, "ref", no_generator_refs)  # WeakSet binds its own name at import
    generator = secret.secret_generator()
    assert secret.is_secret(generator)
    assert torch.rand(3, generator=generator).shape == (3,)


def test_only_the_secret_generator_is_secret():
    generator = secret.secret_generator()
    twin = torch.Generator()
    twin.set_state(generator.get_state())
    assert secret.is_secret(generator) and not secret.is_secret(twin) and not secret.is_secret(None)
    assert torch.equal(torch.randn(4, generator=generator), torch.randn(4, generator=twin))


@pytest.mark.parametrize("draw", [torch.randperm, lambda n, generator: torch.randint(0, 9, (n,), generator=generator)])
def test_torch_draws_accept_the_secret_generator(draw):
    assert draw(5, generator=secret.secret_generator()).shape == (5,)
