"""Personalization as an axis: every way a site gets a personal model, and which of them may run together.

A method is registered here by what it is, never by name checks elsewhere:

- local fine-tuning (``finetune_epochs``, lightning_modules/finetune.py): a ``copy`` of the received model trained
  beside the round, whose scores the site round hands over;
- partial sharing (``local_keys``: FedPer, FedBN; lightning_modules/personalization/partial_sharing.py): the
  trained ``module`` with the site's own local entries;
- every client algorithm that declares a ``personal_model`` (lightning_modules/algorithms/capabilities.py):
  FedRep (its head: a ``module``), Ditto and APFL (``weights`` of their own). A new one is one registry line in
  lightning_modules/algorithms/registry.py; nothing here changes.

Each personal model is scored on the site's validation split and sent as ``eval.personal_<metric>``. Two methods may
run together only when they make ONE personal model: ``weights`` load into a copy of the trained module, which keeps
its local entries, so a ``weights`` method composes with partial sharing. A ``copy`` is another model: with any
other method both would be reported as ``personal_*`` and one would overwrite the other's scores, so the job
builder refuses the pair (`collision`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_modules.algorithms.capabilities import PersonalModel

#: Local fine-tuning's personal model: scored by the site round, handed over (``add_personal_scores``).
FINETUNE = PersonalModel("copy", "the fine-tuned copy of the received model")
#: Partial sharing's personal model: the trained module, its shared entries with the site's own local ones.
PARTIAL_SHARING = PersonalModel("module", "the trained module with the site's own local entries")


@dataclass(frozen=True)
class ActiveMethod:
    """A method a job turns on: the setting that does it, as refusals name it, and its personal model."""

    setting: str
    model: PersonalModel


def personal_methods(client_algorithms: Mapping[str, type]) -> dict[str, PersonalModel]:
    """The registry of the axis: fine-tuning, partial sharing and every client algorithm declaring a personal model."""
    methods = {"finetune": FINETUNE, "partial_sharing": PARTIAL_SHARING}
    methods |= {name: cls.personal_model for name, cls in client_algorithms.items() if cls.personal_model}
    return methods


def active_methods(client_cls: type, finetune_epochs: int, has_local_keys: bool) -> list[ActiveMethod]:
    """The personal methods a job's settings turn on, the client algorithm's first. A client whose personal model
    is a ``module`` (FedRep) holds the local entries as its head: they are its method, not partial sharing too."""
    declared = client_cls.personal_model
    active = []
    if declared:  # a head kept at the site is set by local_keys: the refusal names that setting
        head = declared.kind == "module"
        setting = f"local_keys (the head of client '{client_cls.name}')" if head else f"client '{client_cls.name}'"
        active.append(ActiveMethod(setting, declared))
    if has_local_keys and not (declared and declared.kind == "module"):
        active.append(ActiveMethod("local_keys (FedPer/FedBN)", PARTIAL_SHARING))
    if finetune_epochs:
        active.append(ActiveMethod(f"finetune_epochs {finetune_epochs}", FINETUNE))
    return active


def collision(active: list[ActiveMethod]) -> str | None:
    """Why these methods cannot run together (one line), or ``None``: a ``copy`` beside any other method."""
    copies = [method for method in active if method.model.kind == "copy"]
    others = [method for method in active if method.model.kind != "copy"]
    if not copies or not others:
        return None
    mine, other = copies[0], others[0]
    return (
        f"{mine.setting} with {other.setting}: {other.model.what} is already the site's personal model and "
        f"{mine.model.what} would be another; both would be reported as personal_* and one would overwrite the "
        "other's scores; choose one"
    )
