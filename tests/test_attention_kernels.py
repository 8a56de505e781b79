"""The attention kernels this project's models may run through (`training/core/attention_kernels.py`); the GPU test
`test_a_left_padded_bf16_batch_trains_with_finite_gradients` checks the gradients they give on CUDA."""
from __future__ import annotations

import logging

import pytest
import torch

import inference.chatbot as chatbot_module
import training.core.engine as engine_module
from training.core import attention_kernels
from training.core.attention_kernels import exclude_cudnn_attention
from training.core.engine import OptimizationSettings, create_frozen_engine, create_train_engine
from training.core.model_loading import load_tokenizer
from training.core.reward_model import RewardModel

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


def test_each_tool_runs_its_model_on_the_accelerators_device_choosing_its_kernels(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """prompt_eval and rw_eval left their models on the CPU of a GPU machine (the chatbot moved its own): a reward
    model was scored on the CPU, in the dtype chosen for the GPU. An accelerator named "meta" shows where each tool's
    model goes."""
    from deepspeed.accelerator import get_accelerator

    from step1_sft import prompt_eval
    from step2_reward import rw_eval

    seen = []
    monkeypatch.setattr(attention_kernels, "exclude_cudnn_attention", seen.append)
    monkeypatch.setattr(type(get_accelerator()), "device_name", lambda self, device_index=None: "meta")
    llama = tiny_model_dir("llama")
    tokenizer = load_tokenizer(llama)
    RewardModel.from_causal_lm(llama, tokenizer).save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")
    models = [prompt_eval.load_for_generation(llama, torch.float32)[0],
              rw_eval.RewardScorer.from_pretrained(str(tmp_path / "reward")).model,
              chatbot_module.load_session(chatbot_module.build_parser().parse_args(["--path", llama])).model]
    assert [next(model.parameters()).device.type for model in models] == seen == ["meta"] * 3
    assert not any(model.training for model in models)
