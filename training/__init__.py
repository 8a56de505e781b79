"""Shared machinery of the three steps, in layers (each imports only the layers listed before it):

- `training.core`: models and DeepSpeed: loading (hub, local, embedded), the reward/critic model,
  LoRA, the DeepSpeed config and engines, optimizers, saving.
- `training.algorithms`: the RL arithmetic as pure tensor functions (imports `training.core` only):
  masked statistics, KL shaping and controllers, advantage estimators and losses by name.
- `training.generation`: the hybrid engine that switches the actor between ZeRO training and fast
  decoding (fused Llama path, KV cache, tensor parallelism, prepacked CPU weights).
- `training.reliability`: checkpoints and resume, run locks, signals, guards, input validation,
  the run folder's records.
- `training.loops`: the supervised training loop, resumable batch streams, metrics.
- `training.pipeline`: `train.py`'s planner and launcher over the step registry.

Below them all, `utils` holds errors, distributed helpers, atomic writes and the data layer.
"""
