"""Step 3's command line: one typed group per concern (see `training.core.args`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from step3_rlhf.ppo_trainer import PPOConfig
from training.core.args import ModelTrainingConfig, RunArguments, ScheduleSettings, group
from training.generation.generator import SamplingSettings
from training.generation.hybrid_engine import HybridEngineSettings
from training.placement.settings import PlacementSettings
from training.reliability.checkpointing import CheckpointSettings
from utils.data import DataArguments, UnsupervisedDataArguments


@dataclass
class Step3Models:
    actor_model_name_or_path: str = field(metadata={
        "help": "the step-1 run folder (or any causal LM): the actor and the frozen reference"})
    critic_model_name_or_path: str | None = field(default=None, metadata={
        "help": "the step-2 run folder: the frozen reward model and the critic's initialisation (optional with "
                "--reward_fn: without it a reward function alone scores the answers, and a critic starts from the "
                "actor's model with a new value head)"})


@dataclass
class RewardFunctionSettings:
    """A program that scores answers, alone or added to the reward model's score."""

    reward_fn: str | None = field(default=None, metadata={
        "help": "score answers with a Python function (prompt, answer, row metadata) -> float: 'builtin:math' (the "
                "final number equals the row's answer), 'builtin:format', 'module:function' or 'file.py:function'"})
    reward_fn_coef: float = field(default=1.0, metadata={
        "help": "weight of --reward_fn in the score (added to the reward model's score when there is one)"})


@dataclass
class PPOLoopArguments:
    """Rollout and update batches, passes and held-out evaluation."""

    per_device_generation_batch_size: int = field(default=4, metadata={"help": "prompts per rollout batch per rank"})
    per_device_training_batch_size: int = field(default=4, metadata={"help": "PPO micro-batch size per rank"})
    generation_batches: int = field(default=1, metadata={"help": "rollout batches collected per PPO step"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each PPO step's experiences"})
    num_train_epochs: int = field(default=1, metadata={"help": "passes over the prompt set"})
    eval_interval: int = field(default=0, metadata={
        "help": "score held-out prompts every N PPO steps (0: only before and after training)"})
    eval_samples: int = field(default=32, metadata={"help": "held-out prompts scored per evaluation (per rank)"})
    max_train_minutes: float | None = field(default=None, metadata={
        "resume_override": True,
        "help": "start no PPO step after this many minutes of training in this process (then evaluate and save "
                "as usual): a time budget instead of, or besides, --max_steps"})


@dataclass
class RolloutSampling(SamplingSettings):
    """Rollouts are drawn from the full distribution at `temperature` (top-p/top-k are refused)."""

    temperature: float = field(default=1.0, metadata={
        "help": "rollout sampling temperature; the policy PPO trains (old, new and reference log-probs, KL, entropy) "
                "is softmax(logits / temperature), the distribution the answers are drawn from"})
    top_p: float = field(default=1.0, metadata={
        "help": "refused below 1: truncated sampling would train on other log-probs than drew the tokens"})
    top_k: int = field(default=0, metadata={
        "help": "refused above 0: truncated sampling would train on other log-probs than drew the tokens"})


@dataclass
class EMASettings:
    enable_ema: bool = field(default=False, metadata={"help": "keep an EMA of the actor, saved as actor_ema/"})
    ema_beta: float = field(default=0.992, metadata={"help": "EMA decay per actor optimizer step"})


@dataclass
class FrozenModels:
    offload_reference_model: bool = field(default=False, metadata={"help": "keep the reference model in CPU memory"})
    offload_reward_model: bool = field(default=False, metadata={"help": "keep the reward model in CPU memory"})


@dataclass
class Step3Settings:
    """Everything step 3 is told; `ppo.temperature` follows `--temperature`."""

    models: Step3Models
    rewards: RewardFunctionSettings
    run: RunArguments
    data: DataArguments
    unsupervised: UnsupervisedDataArguments
    loop: PPOLoopArguments
    ppo: PPOConfig
    sampling: RolloutSampling
    ema: EMASettings
    actor: ModelTrainingConfig = group("actor_")
    critic: ModelTrainingConfig = group("critic_")
    schedule: ScheduleSettings
    frozen: FrozenModels
    hybrid: HybridEngineSettings
    placement: PlacementSettings
    checkpoints: CheckpointSettings

    def __post_init__(self) -> None:
        self.ppo.temperature = self.sampling.temperature

