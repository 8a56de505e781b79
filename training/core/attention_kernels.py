"""Which of torch's attention kernels (`scaled_dot_product_attention` backends) this project's models may run
through on a GPU: every kernel but cuDNN's, which is torch's first choice on H100/H200 and wrong in two ways there
and on B200.

- Training. From torch 2.11 cuDNN's backward returns NaN query gradients when a mask tensor is passed, the sequence
  is 64 positions past a multiple of 128 and some query row's log-sum-exp is under ln(FLT_MAX) = -88.7 (pytorch
  issue 196678; TRL's DPO trainer hit it, issue 7181). A left-padded prompt batch, every PPO batch, has such rows:
  the padding's queries see no key. The loss stays finite (the padded positions are masked out of it) while the
  gradients turn NaN, and DeepSpeed skips the step. On an H200, `bench/step3.py` (ZeRO-3, bf16) lost 2 of its 12
  actor and critic steps so, with finite losses: this bug's signature, not yet confirmed as it on a GPU
  (`bench/attention_backward.py` tells).
- Generation. On B200 (sm_100) cuDNN's kernel has corrupted greedy generation of models with fewer than 8 key/value
  heads (pytorch issue 193893, torch 2.11 to 2.13), SmolLM2's 3 among them.

Flash and memory-efficient attention serve the same shapes at about the same speed. Every engine this project
makes (`training/core/engine.py`) and the chatbot's model leave cuDNN out, so a process's generation, scoring and
training attend through the same kernels.
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
    logger.info("attention: cuDNN's kernel left out on the GPU (on H100/H200 its backward returns NaN gradients for "
                "left-padded batches, pytorch issue 196678; on B200 it has corrupted generation, issue 193893; "
                "torch %s); flash and memory-efficient attention serve instead", torch.__version__)
    return True
