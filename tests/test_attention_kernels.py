"""The attention kernels this project's models may run through (`training/core/attention_kernels.py`); the GPU test
`test_a_left_padded_bf16_batch_trains_with_finite_gradients` checks the gradients they give on CUDA."""
from __future__ import annotations

import logging

import pytest
import torch

import inference.chatbot as chatbot_module
import training.core.engine as engine_module
from training.core.attention_kernels import exclude_cudnn_attention
from training.core.engine import OptimizationSettings, create_frozen_engine, create_train_engine


pytestmark = pytest.mark.usefixtures("cudnn_attention_restored")


def test_on_cuda_cudnn_attention_is_left_out_once_and_said_once(caplog):
    with caplog.at_level(logging.INFO, logger="training.core.attention_kernels"):
        assert exclude_cudnn_attention("cuda")
        assert not exclude_cudnn_attention("cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert [record.message.count("pytorch issue 196678") for record in caplog.records] == [1]


@pytest.mark.parametrize("device_type", ["cpu", "xpu"])
def test_other_devices_keep_every_kernel(device_type):
    assert not exclude_cudnn_attention(device_type)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.fixture
def engines_without_deepspeed(monkeypatch) -> list[str]:
    """`deepspeed.initialize` replaced by the model itself; returns the devices `exclude_cudnn_attention` was asked
    about."""
    seen = []
    monkeypatch.setattr(engine_module, "exclude_cudnn_attention", seen.append)
    monkeypatch.setattr(engine_module.deepspeed, "initialize", lambda **kwargs: (kwargs["model"], None, None, None))
    monkeypatch.setattr(engine_module, "skip_single_rank_gradient_allreduce", lambda engine: None)
    return seen


def test_every_engine_chooses_its_devices_kernels(engines_without_deepspeed):
    """`create_train_engine` and `create_frozen_engine` pass the accelerator's device (on a GPU machine "cuda",
    which leaves cuDNN out)."""
    model = torch.nn.Linear(2, 2)
    assert create_train_engine(model, OptimizationSettings(learning_rate=1e-3, num_training_steps=1,
                                                           optimizer="torch_adamw")) is model
    assert create_frozen_engine(torch.nn.Linear(2, 2)) is not None
    assert engines_without_deepspeed == [engine_module.get_accelerator().device_name()] * 2 == ["cpu", "cpu"]


def test_the_chatbot_chooses_its_devices_kernels(tiny_model_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(chatbot_module, "exclude_cudnn_attention", seen.append)
    chatbot_module.load_session(chatbot_module.build_parser().parse_args(["--path", tiny_model_dir("llama")]))
    assert seen == ["cpu"]
