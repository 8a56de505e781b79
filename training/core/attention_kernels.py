"""Which of torch's attention kernels (`scaled_dot_product_attention` backends) a process that trains on a GPU lets
torch pick.

cuDNN's kernel is torch's first choice on H100/H200. From torch 2.11 its backward returns NaN query gradients when
a mask tensor is passed, the sequence length is 64 past a multiple of 128 and some query row's log-sum-exp is under
ln(FLT_MAX) = -88.7 (pytorch issue 196678; TRL's DPO trainer hit it too, issue 7181). A left-padded prompt batch, every
PPO batch, has such rows: the padding's queries see no key. The loss stays finite (the padded positions are masked
out of it) while every gradient turns NaN, and DeepSpeed skips the step ("OVERFLOW! Skipping step"). On an H200,
`bench/step3.py` (ZeRO-3, bf16) lost 2 of its 12 actor and critic steps so, with finite losses: this bug's signature,
not yet confirmed as it on a GPU. The flash and memory-efficient
kernels serve the same shapes at the same speed, so the process leaves cuDNN's out, for generation and scoring too:
the old log-probs, the rollout's sampling and the training forward then attend through the same kernels.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def exclude_cudnn_attention(device_type: str) -> bool:
    """On a CUDA device, take cuDNN's attention kernel out of the ones torch may pick, for this process; True when
    this call did (it tells the user once), False on other devices or when it was already out."""
    if device_type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    logger.info("attention: cuDNN's kernel left out on the GPU (its backward returns NaN gradients for left-padded "
                "batches on H100/H200 with torch %s, pytorch issue 196678); flash and memory-efficient serve instead",
                torch.__version__)
    return True
