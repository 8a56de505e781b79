"""What one PPO step of step 3 processes, as the cost model sees it, and how step 3's settings give it.

Only the settings' values are read (no model or engine is built), so the planner can run before anything loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.core.optim import uses_master_weights
from training.pipeline.hardware import ModelSize

if TYPE_CHECKING:
    from step3_rlhf.settings import Step3Settings

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def ppo_micro_batches(ppo_epochs: int, generation_batches: int, rows_per_generation_batch: int,
                      micro_batch: int) -> int:
    """Training micro-batches of one PPO step on a rank: every generation batch's rows split by `micro_batch`, in
    each PPO epoch (as `PPORun.train_on` splits them)."""
    return ppo_epochs * generation_batches * -(-rows_per_generation_batch // micro_batch)


@dataclass(frozen=True)
class Step3Workload:
    """One PPO step's shapes and the trained models' settings. A *chunk* is one rank's prompt batch:
    `prompts_per_rank` prompts x `samples_per_prompt` answers = `rows_per_chunk` rows."""

    actor: ModelSize
    critic: ModelSize | None
    reward: ModelSize | None
    prompts_per_rank: int
    samples_per_prompt: int
    prompt_len: int
    answer_len: int
    ppo_epochs: int = 1
    train_micro_batch: int = 4
    dtype: str = "bf16"
    actor_zero_stage: int = 0
    critic_zero_stage: int = 0
    # the rank of the actor's LoRA adapters where only they train (--actor_lora_dim with --actor_only_optimize_lora;
    # 0: every weight trains), on the linear layers --actor_lora_module_name selects; the critic's by its own flags
    actor_lora_dim: int = 0
    actor_lora_module_name: str = "layers."
    critic_lora_dim: int = 0
    critic_lora_module_name: str = "layers."
    generation_batches: int = 1  # the chunk's prompts come in this many generation batches, each split on its own
    accumulation: int = 1  # --gradient_accumulation_steps: a PPO step's micro-batches must make whole steps of it
    optimizer_offloaded: tuple[str, ...] = ()  # trained models whose optimizer state is in CPU memory (ZeRO >= 1)
    optimizer: str = "auto"  # --optimizer, resolved for `device` (`master_weights`)
    device: str = "cuda"  # the planned ranks' device: "cpu" where planned from this machine's calibration
    hybrid_engine: bool = True
    inference_tp: int = 1
    keep_inference_copy: bool = False  # the hybrid engine's inference copy held through training too
    stage_fusion: bool = False  # finished rows scored while generation goes on (`step3_rlhf.stage_fusion`)
    stage_fusion_micro_batch: int = 2
    offloaded: tuple[str, ...] = ()  # frozen models kept in CPU memory (ZeRO-3 parameter offload)

    def master_weights(self, role: str) -> bool:
        """Whether the trained model `role` is updated by `MasterWeightAdamW` at its ZeRO stage here (the planner
        tries several), as `training.core.optim.uses_master_weights` decides for the run: its gradients are then
        summed, and all-reduced, in fp32."""
        stage = self.actor_zero_stage if role == "actor" else self.critic_zero_stage
        return uses_master_weights(self.dtype, stage, role in self.optimizer_offloaded, self.optimizer, self.device)

    def lora_adapters(self, role: str) -> tuple[int, str]:
        """The trained model `role`'s LoRA rank where only its adapters train (0: every weight trains) and the
        --lora_module_name of the layers they wrap."""
        if role == "actor":
            return self.actor_lora_dim, self.actor_lora_module_name
        return self.critic_lora_dim, self.critic_lora_module_name

    @property
    def rows_per_chunk(self) -> int:
        return self.prompts_per_rank * self.samples_per_prompt

    @property
    def rows_per_generation_batch(self) -> int:
        return self.rows_per_chunk // self.generation_batches

    def whole_optimizer_steps(self, micro_batch: int) -> bool:
        """Whether training micro-batches of `micro_batch` rows make whole optimizer steps of the accumulation in a
        PPO step (`check_args` refuses otherwise)."""
        micro_batches = ppo_micro_batches(self.ppo_epochs, self.generation_batches, self.rows_per_generation_batch,
                                          micro_batch)
        return micro_batches % self.accumulation == 0

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def roles(self) -> tuple[str, ...]:
        """The models present: the actor and the reference always, the critic and reward model when given."""
        return tuple(role for role, size in (("actor", self.actor), ("critic", self.critic),
                                              ("reference", self.actor), ("reward", self.reward)) if size is not None)


def step3_workload(args: Step3Settings, actor: ModelSize, critic: ModelSize | None, reward: ModelSize | None,
                   dtype: str | None = None) -> Step3Workload:
    """Step 3's settings as a workload; `critic`/`reward` are the sizes of the models the run holds (None where
    the algorithm trains no critic or a reward function alone scores). `dtype`: the dtype planned for (default:
    `--dtype` resolved on this machine)."""
    return Step3Workload(
        actor=actor, critic=critic, reward=reward,
        prompts_per_rank=args.loop.per_device_generation_batch_size * args.loop.generation_batches,
        samples_per_prompt=args.ppo.n_samples_per_prompt or 1,
        prompt_len=args.data.max_prompt_seq_len, answer_len=args.ppo.max_answer_seq_len,
        ppo_epochs=args.loop.ppo_epochs, train_micro_batch=args.loop.per_device_training_batch_size,
        dtype=dtype or args.run.dtype_name, actor_zero_stage=args.actor.zero_stage,
        critic_zero_stage=args.critic.zero_stage,
        actor_lora_dim=args.actor.lora_dim if args.actor.only_optimize_lora else 0,
        actor_lora_module_name=args.actor.lora_module_name,
        critic_lora_dim=args.critic.lora_dim if args.critic.only_optimize_lora else 0,
        critic_lora_module_name=args.critic.lora_module_name,
        generation_batches=args.loop.generation_batches, accumulation=args.schedule.gradient_accumulation_steps,
        optimizer_offloaded=tuple(role for role, model in (("actor", args.actor), ("critic", args.critic))
                                  if model.offload),
        optimizer=args.schedule.optimizer, device=planned_device(args.placement.hardware_file),
        hybrid_engine=args.hybrid.backend == "hybrid", inference_tp=args.hybrid.inference_tp_size,
        keep_inference_copy=args.hybrid.keep_inference_copy,
        stage_fusion=args.placement.enable_stage_fusion,
        stage_fusion_micro_batch=args.placement.stage_fusion_micro_batch_size,
        offloaded=offloaded_models(args))


def planned_device(hardware_file: str | None) -> str:
    """The device the planned ranks train on, as `--optimizer auto` is resolved for it: a hardware file's GPUs, else
    this machine's CPU (`auto.planning_machine` plans a CPU calibration or a hardware file)."""
    return "cuda" if hardware_file else "cpu"


def offloaded_models(args: Step3Settings) -> tuple[str, ...]:
    """The frozen models the run keeps in CPU memory (`--offload_reference_model`, `--offload_reward_model`)."""
    return tuple(role for role, offload in (("reference", args.frozen.offload_reference_model),
                                            ("reward", args.frozen.offload_reward_model)) if offload)


def step3_model_paths(args: Step3Settings) -> dict[str, str | None]:
    """The model each role loads from (None: absent): the critic starts from the step-2 model, or from the actor's
    when a reward function alone scores; the reward model exists only with a step-2 model."""
    from training.algorithms import get_advantage_estimator

    actor = args.models.actor_model_name_or_path
    scorer = args.models.critic_model_name_or_path
    needs_critic = get_advantage_estimator(args.ppo.advantage_estimator).needs_critic
    return {"actor": actor, "critic": (scorer or actor) if needs_critic else None, "reward": scorer}
