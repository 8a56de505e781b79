"""Models and DeepSpeed: loading, the reward/critic model, LoRA, engines, optimizers, saving."""
