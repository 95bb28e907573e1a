"""`NanGuard`: a NaN/inf loss or gradient skips that optimizer step, and a run that keeps producing them stops.

One bad batch (a spike, a corrupt sample) should not poison the weights or the optimizer's moments; a run whose
every step is non-finite has diverged and should stop with a message rather than burn the budget. The decision
is global: each rank checks its loss and the gradients its optimizer holds (a ZeRO shard, a TP slice, a pipeline
stage), and one max-all-reduce over the world makes every rank skip or stop together, or sharded ranks would
drift apart. The checks stay on the device until one read of both flags per optimizer step: the callback
decides on the host whether to skip, so it costs one host sync per step (opt-in; tests/test_host_sync.py).

    policy="skip"  skip the bad step (gradients zeroed, parameters and optimizer state untouched); stop once
                   `max_consecutive` steps in a row were bad
    policy="stop"  stop at the first bad step

A skipped step still counts as a step (global_step and the LR schedule advance), so resumes stay aligned.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lit_lm.strategies import comm

POLICIES = ("skip", "stop")


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite losses or gradients."""


class NanGuard(L.Callback):
    def __init__(self, policy: str = "skip", max_consecutive: int = 3) -> None:
        if policy not in POLICIES:
            raise ValueError(f"NanGuard: policy={policy!r}; choose one of {', '.join(POLICIES)}")
        if max_consecutive < 1:
            raise ValueError(f"NanGuard: max_consecutive must be >= 1, got {max_consecutive}")
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.consecutive = 0  # bad steps in a row
        self.skipped = 0  # bad steps skipped in the whole run
        self._loss_bad: Optional[Tensor] = None  # on the device: any non-finite loss since the last step

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Optimizer) -> None:
        """The flags stay on the device up to one read per step (the skip is decided on the host)."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        no = torch.zeros((), dtype=torch.bool, device=pl_module.device)
        grads_bad = ~torch.isfinite(torch.stack(torch._foreach_norm(grads))).all() if grads else no
        flags = torch.stack([no if self._loss_bad is None else self._loss_bad, grads_bad.to(no.device)]).float()
        self._loss_bad = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = comm.scalar_all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_bad, grads_bad = flags.tolist()  # the one host read
        if not (loss_bad or grads_bad):
            self.consecutive = 0
            return
        self.consecutive += 1
        what = " and ".join(name for name, bad in (("loss", loss_bad), ("gradients", grads_bad)) if bad)
        if self.policy == "stop" or self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"NanGuard: non-finite {what} at step {trainer.global_step} ({self.consecutive} bad step(s) in a row, "
                f"policy={self.policy}, max_consecutive={self.max_consecutive}): the run has diverged. Lower the "
                "learning rate, check the data around this step, or resume from an earlier checkpoint")
        rank_zero_warn(f"NanGuard: non-finite {what} at step {trainer.global_step}: optimizer step skipped "
                       f"({self.consecutive}/{self.max_consecutive} in a row)")
        self.skipped += 1
        _skip_next_step(optimizer, grads)

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consecutive, self.skipped = state_dict["consecutive"], state_dict["skipped"]


def _skip_next_step(optimizer: Optimizer, grads: list[Tensor]) -> None:
    """Make the update that follows a no-op. Lightning calls this hook from inside `optimizer.step(closure)`, so
    the step cannot be cancelled: hide its parameters until it returns instead (torch optimizers update only the
    parameters of their groups, so state and weights stay as they are). Zeroing the gradients keeps the global
    -norm clipping that runs in between finite."""
    torch._foreach_zero_(grads)
    hidden = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = []

    def restore(*_: Any) -> None:
        for group, params in zip(optimizer.param_groups, hidden):
            group["params"] = params
        handle.remove()

    handle = optimizer.register_step_post_hook(restore)
