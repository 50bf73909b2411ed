"""A site that trains with several processes (Lightning DDP under torchrun, ``devices > 1``).

NVFlare's client API talks to the control rank only (global rank 0): on the other ranks ``flare.is_running()`` is
``False`` and ``flare.receive()`` is ``None``. So rank 0 decides what happens next (train a round, score the final
model, stop) and every rank follows through a broadcast, the way NVFlare's own Lightning callback shares the
received model. Every rank computes the same algorithm state (DDP averages the gradients before the algorithm's
correction), and only rank 0 writes it (`lightning_modules.state_store.is_writer`).

The process group is created here, before the first Trainer, because the loop needs collectives before Lightning
would create it; Lightning's DDP strategy then reuses it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from lightning_modules.algorithms.base import ClientAlgorithmError


def local_processes() -> int:
    """Processes torchrun started on this machine for the site (1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_launch(devices: int, site: str = "local") -> None:
    """``devices > 1`` needs exactly that many processes from torchrun (the job's launcher starts them)."""
    if devices > 1 and local_processes() != devices:
        raise ClientAlgorithmError(
            f"{site}: devices={devices} needs the client started by torchrun with --nproc_per_node={devices} "
            f"(the job's launcher does this); this process sees {local_processes()}"
        )


def init_site_processes(devices: int, accelerator: str) -> int:
    """Join the site's process group when ``devices > 1``; return this process's global rank (0 alone)."""
    if devices == 1:
        return 0
    check_launch(devices)
    if not dist.is_initialized():
        use_gpu = accelerator != "cpu" and torch.cuda.is_available()
        if use_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_gpu else "gloo")
    return dist.get_rank()


def close_site_processes() -> None:
    """Leave the site's process group (nothing without one).

    Without this, the process group's background threads are still running when the interpreter exits, and a rank
    can abort in C++ ("terminate called without an active exception"), which torchrun reports as a failed site
    even though every round completed. The barrier first lets every rank finish its last collective.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def share_from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (unchanged without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def next_task(flare: Any) -> tuple[str, int]:
    """On rank 0: what NVFlare asks for next, ``("train" | "evaluate" | "cross_site" | "stop", round)``."""
    import nvflare.client as flare_api

    if not flare.is_running():
        return "stop", 0
    received = flare.receive()
    if received is None:
        return "stop", 0
    from lightning_modules.cross_site import is_cross_site_task

    if is_cross_site_task(flare_api.get_task_name()):
        return "cross_site", received.current_round or 0
    return ("evaluate" if flare_api.is_evaluate() else "train"), received.current_round or 0
