"""AdamW for bf16 weights through fp32 master copies, in a few whole-list kernels: the ZeRO-0 bf16 update.

DeepSpeed trains bf16 weights at ZeRO-0 through its unfused mixed-precision wrapper, which walks the parameters
one by one several times a step: an inf/NaN scan of each gradient, a fresh fp32 copy of it, a norm each, the
clip, then Adam over the fp32 masters and a copy back (0.44 s a step at SmolLM2-135M on a 2-core CPU).
`MasterWeightAdamW` makes the same update in 0.21 s: it takes one total norm of the fp32 gradients (a non-finite
norm is the overflow check: the step is skipped, as DeepSpeed skips it), clips with DeepSpeed's rule inside
torch's fused AdamW over the masters, and copies them back into the bf16 weights. DeepSpeed's engine runs in fp32
mode over it (`training.core.optim.uses_master_weights`), which leaves the bf16 weights as they are.

The gradients of a step's micro-batches (`--gradient_accumulation_steps`) are summed in fp32, as DeepSpeed's GPU
bf16 optimizer sums them: a hook on each trained weight adds the bf16 gradient of each backward into its master's
fp32 `grad` (kept allocated from step to step) and releases the weight's own, which autograd would otherwise sum
in bf16 (a median relative error of 0.36% at 8 micro-batches). Over several data-parallel ranks the engine's
all-reduce after the step's last backward averages these fp32 sums: it reduces what `get_grads_for_reduction`
hands it, as it does for its own bf16 optimizer. With one micro-batch a step the gradient is the bf16 one cast to
fp32, as before.

One difference from the wrapper, on purpose: the wrapper creates Adam's state with a zero-gradient step, so its
step counts start at 1 and its first updates are smaller than Adam's (0.73 lr at betas (0.9, 0.95)); here they
start at 0, as torch's AdamW does for fp32 weights.
"""
from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class MasterWeightAdamW(torch.optim.AdamW):
    """Fused AdamW over fp32 copies of low-precision parameters; `step` reads their fp32 gradient sums and writes
    the masters back.

    `param_groups` hold the fp32 masters (what the scheduler and the optimizer state see); `model_params` the
    trained tensors, in the same order. Each backward's gradient of a trained tensor is added into its master's
    fp32 `grad` by a hook (`_add_gradient`); one set on the tensor by hand is added at the step. `max_grad_norm` > 0
    clips the total gradient norm as DeepSpeed does. `_global_grad_norm` and `overflow` after a step are what
    DeepSpeed's engine reads from its optimizer.
    """

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], max_grad_norm: float = 0.0):
        self.model_params: list[torch.nn.Parameter] = [param for group in groups for param in group["params"]]
        master_groups = [{**group, "params": [param.detach().float() for param in group["params"]]} for group in groups]
        super().__init__(master_groups, lr=lr, betas=betas, fused=True)
        self.max_grad_norm = max_grad_norm
        self.overflow = False
        self._global_grad_norm = 0.0
        self._masters = self.masters()
        self._summed: set[int] = set()  # indexes of the masters whose `grad` holds this step's sum so far
        self._hooks = [param.register_post_accumulate_grad_hook(partial(_hand_gradient_over, weakref.ref(self), index))
                       for index, param in enumerate(self.model_params)]
        weakref.finalize(self, _remove_hooks, self._hooks)

    def masters(self) -> list[torch.Tensor]:
        return [master for group in self.param_groups for master in group["params"]]

    @torch.no_grad()
    def _add_gradient(self, index: int, param: torch.Tensor) -> None:
        """Add `param`'s gradient into its master's fp32 sum and release it, so that the next backward's gradient
        is not summed with this one in `param`'s precision."""
        if param.grad is None:  # taken by another hook on the same weight
            return
        master = self._masters[index]
        if index in self._summed:
            master.grad.add_(param.grad)
        else:
            self._warm_gradient(master).copy_(param.grad)
            self._summed.add(index)
        param.grad = None

    @staticmethod
    def _warm_gradient(master: torch.Tensor) -> torch.Tensor:
        """`master.grad`, allocated at the first step and kept: a step's first cast writes into warm memory."""
        if master.grad is None:
            master.grad = torch.empty_like(master)
        return master.grad

    @torch.no_grad()
    def get_grads_for_reduction(self) -> tuple[list[torch.Tensor], dict]:
        """This step's fp32 gradient sums, complete (zeros where a trained tensor got no gradient, so that every
        rank reduces the same tensors), and no expert gradients. DeepSpeed's engine all-reduces these in place after
        the last backward of a step where it runs its all-reduce (several data-parallel ranks)."""
        for index, param in enumerate(self.model_params):
            if param.grad is not None:
                self._add_gradient(index, param)
            elif index not in self._summed:
                self._warm_gradient(self._masters[index]).zero_()
                self._summed.add(index)
        return [master.grad for master in self._masters], {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients: the sums start again at the next backward (their buffers stay allocated)."""
        self._summed.clear()
        for param in self.model_params:
            param.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MasterWeightAdamW takes no closure")
        grads, _ = self.get_grads_for_reduction()
        self._summed.clear()
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            return
        # DeepSpeed's clipping rule (its bf16 wrapper's): divide by (norm + 1e-6) / max where that exceeds 1; the
        # fused kernel divides by `grad_scale` as it reads each gradient
        ratio = (norm + 1e-6) / self.max_grad_norm if self.max_grad_norm > 0 else 1.0
        masters = self._masters
        self.grad_scale = torch.tensor(ratio, dtype=torch.float32, device=masters[0].device) if ratio > 1 else None
        super().step()
        torch._foreach_copy_(self.model_params, masters)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = [master.detach() for master in self.masters()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also reads the state DeepSpeed's bf16 wrapper saved (a checkpoint of this project from before)."""
        if "fp32_groups" in state_dict:
            state = state_dict["optimizer_state_dict"]
            saved = [master for group in state_dict["fp32_groups"] for master in group]
        else:
            state = dict(state_dict)
            saved = state.pop("master_weights", None)
            if saved is None:
                raise ValueError("this optimizer state holds no fp32 master weights: it was written for another "
                                 "precision or ZeRO stage")
        super().load_state_dict(state)
        with torch.no_grad():
            for master, value in zip(self.masters(), saved, strict=True):
                master.copy_(value)


def _hand_gradient_over(optimizer: weakref.ref[MasterWeightAdamW], index: int, param: torch.Tensor) -> None:
    """A trained weight's gradient hook: it holds its optimizer weakly, so that the hooks, which live as long as the
    weight, do not keep a dropped optimizer (its fp32 masters and Adam state) alive."""
    alive = optimizer()
    if alive is not None:
        alive._add_gradient(index, param)


def _remove_hooks(hooks: list[RemovableHandle]) -> None:
    """Once an optimizer is freed, its hooks leave its weights: a later backward keeps the gradient in `grad`."""
    for hook in hooks:
        hook.remove()
