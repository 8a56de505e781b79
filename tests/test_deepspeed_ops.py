"""FusedAdam's build under a TORCH_CUDA_ARCH_LIST with architecture letters ("9.0a", as PyTorch's Hopper images set
it), which DeepSpeed's op builder cannot parse: the H200 run of `pytest -m gpu` and of `train.py` stopped there."""
import os

import pytest
import torch

from training.core import optim
from training.core.deepspeed_ops import plain_arch_list
from utils.errors import UserError


@pytest.mark.parametrize("arch_list,plain", [
    ("9.0a", "9.0"), ("8.0 9.0a;10.0f+PTX", "8.0;9.0;10.0+PTX"), ("8.0;8.6+PTX", "8.0;8.6+PTX"), ("12.0a", "12.0")])
def test_architecture_letters_are_dropped(arch_list, plain):
    assert plain_arch_list(arch_list) == plain


def test_fused_adam_builds_its_op_for_a_lettered_arch_list_and_the_variable_is_restored(monkeypatch):
    """A stand-in for FusedAdam runs what the real one's first construction runs before nvcc, DeepSpeed's CUDA
    builder reading the variable (`compute_capability_args` in JIT mode); a CPU machine cannot run the rest."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    seen = []

    class BuildingFusedAdam(torch.optim.AdamW):
        def __init__(self, params, lr, betas, adam_w_mode):
            builder = FusedAdamBuilder()
            builder.jit_mode = True
            builder.compute_capability_args()
            seen.append(os.environ["TORCH_CUDA_ARCH_LIST"])
            super().__init__(params, lr=lr, betas=betas)

    monkeypatch.setattr("deepspeed.ops.adam.FusedAdam", BuildingFusedAdam)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    model = torch.nn.Linear(4, 4)
    optimizer = optim.optimizer_of_kind("fused_adam", [{"params": list(model.parameters())}], 1e-3)
    assert isinstance(optimizer, BuildingFusedAdam) and seen == ["9.0+PTX"]
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"


@pytest.mark.parametrize("kind,op,target,instead", [
    ("fused_adam", "fused_adam", "deepspeed.ops.adam.FusedAdam", "--optimizer torch_adamw"),
    ("cpu_adam", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam", "no --offload")])
def test_an_op_that_cannot_be_built_is_a_user_error_saying_what_it_needs_and_what_to_run_instead(
        monkeypatch, kind, op, target, instead):
    """A JIT build's failure (here ninja missing, as torch's cpp_extension reports it) ended the run in a traceback
    from inside DeepSpeed; it is now one line naming the op, the cause, what the build needs and another way."""
    class UnbuildableAdam:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)")

    monkeypatch.setattr(target, UnbuildableAdam)
    with pytest.raises(UserError) as raised:
        optim.optimizer_of_kind(kind, [{"params": list(torch.nn.Linear(2, 2).parameters())}], 1e-3)
    message = str(raised.value)
    assert f"DeepSpeed's {op} op could not be built (RuntimeError: Ninja is required" in message
    assert "ninja" in message and "nvcc" in message and instead in message
    assert isinstance(raised.value.__cause__, RuntimeError)
