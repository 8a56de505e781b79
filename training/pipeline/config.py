"""`train.py`'s own flags, each a dataclass field that HfArgumentParser turns into a `--dashed-flag`.

`PipelineConfig` holds the flags of the run as a whole; `StepFlags` the per-step ones the step registry
calls for (--NAME-args for every step, --NAME-output for every step whose output a later step takes).
"""
from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from transformers.hf_argparser import string_to_bool

from training.algorithms import RL_ALGORITHMS, get_advantage_estimator, get_rl_algorithm
from training.core.model_loading import EMBEDDED_MODEL_NAME
from training.rewards.functions import is_builtin
from utils.errors import UserError

from .deployment import DPO_SAID, DPO_STEP, DeploymentType, Model, Workload
from .launch import LAUNCHER_PROGRAMS, PDSH
from .steps import STEPS, StepSpec, flag_value

_ZERO_STAGES = (0, 1, 2, 3)


DPO = "dpo"
TRUST_REMOTE_CODE_FLAG = "--trust_remote_code"
DEFAULT_TASK_DATA = "task:arithmetic"  # the data of a built-in verifier (--reward_fn builtin:...) without --data_path


@dataclass
class PipelineConfig:
    step: list[int] | None = field(default=None, metadata={
        "choices": tuple(STEPS),
        "help": f"which steps to run, in order (default: 1 2 3; 1 3 with --reward_fn alone; 1 {DPO_STEP} with "
                "--algorithm dpo)"})
    algorithm: str = field(default="ppo", metadata={
        "choices": (*RL_ALGORITHMS.names(), DPO),
        "help": "step 3's RL algorithm (ppo needs a critic; grpo, rloo, reinforce_pp and remax do not), or dpo: "
                f"step 1 then {DPO_SAID} on the preference pairs instead of steps 2 and 3"})
    actor_model: str = field(default=EMBEDDED_MODEL_NAME, metadata={
        "help": f"step 1's base model: hub name or local folder (default: the embedded {EMBEDDED_MODEL_NAME})"})
    reward_model: str = field(default=EMBEDDED_MODEL_NAME, metadata={
        "help": f"step 2's base model: hub name or local folder (default: {EMBEDDED_MODEL_NAME})"})
    actor_zero_stage: int | None = field(default=None, metadata={
        "choices": _ZERO_STAGES, "help": "ZeRO stage of step 1 and step 3's actor (default: picked by the deployment)"})
    reward_zero_stage: int | None = field(default=None, metadata={
        "choices": _ZERO_STAGES,
        "help": "ZeRO stage of step 2 and step 3's critic (default: picked by the deployment)"})
    deployment_type: DeploymentType | None = field(default=None, metadata={
        "help": "cpu runs in this process; the others use the deepspeed launcher "
                "(default: multi_node with --hostfile, else from the local GPU count)"})
    output_dir: Path = field(default=Path("runs/default"), metadata={
        "help": "holds step1/, step2/, step3/, logs/ and summary.json (default: runs/default)"})
    hostfile: str | None = field(default=None, metadata={
        "help": "multi_node: DeepSpeed hostfile, lines 'HOST slots=N'"})
    master_port: int | None = field(default=None, metadata={
        "help": "the launcher's --master_port, where rank 0's store listens (default: on single_gpu and single_node a "
                "port free when each step starts, DeepSpeed's 29500 on multi_node)"})
    master_addr: str | None = field(default=None, metadata={
        "help": "multi_node: the launcher's --master_addr, the first node's address the others reach (default: "
                "under --launcher pdsh the first address `hostname -I` gives on that node, asked over ssh, or "
                "127.0.0.1 for a hostfile of this machine alone; under slurm, impi and openmpi the hostfile's first "
                "node's name, this machine's host name for localhost)"})
    launcher: str = field(default=PDSH, metadata={
        "choices": tuple(LAUNCHER_PROGRAMS),
        "help": "multi_node: the program DeepSpeed's launcher starts the ranks with: pdsh (over ssh, from this "
                "machine), slurm (srun, train.py run inside the allocation), impi (Intel MPI's or MPICH's mpirun), "
                "openmpi (OpenMPI's mpirun)"})
    launcher_args: str | None = field(default=None, metadata={
        "metavar": "ARGS",
        "help": "multi_node: flags of the --launcher's program (pdsh, srun, mpirun), as one quoted string; a single "
                "word beginning with a dash takes '=' (--launcher-args=--allow-run-as-root)"})
    dry_run: bool = field(default=False, metadata={
        "help": "print the settings and the commands, check inputs, and stop"})
    # not flags: the parse's remaining flags (for the steps that accept them) and the per-step flags' values
    extra_args: list[str] = field(default_factory=list, init=False)
    step_args: dict[int, list[str]] = field(default_factory=dict, init=False)
    step_outputs: dict[int, str | None] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir).resolve()
        if self.deployment_type is not None:  # the parser gives the choice's value
            self.deployment_type = DeploymentType(self.deployment_type)

    @property
    def steps(self) -> list[int]:
        """The steps to run, in order, each once: --step, or those the algorithm and --reward_fn call for."""
        if self.step:
            return sorted(set(self.step))
        if self.algorithm == DPO:
            return [1, DPO_STEP]
        return [1, 3] if self.reward_fn is not None else [1, 2, 3]

    def passed_flag(self, flag: str, step: int = 3) -> str | None:
        """The value of a step flag the user passed through train.py (to every step or to `step` only)."""
        return flag_value([*self.extra_args, *self.step_args.get(step, [])], flag)

    @property
    def reward_fn(self) -> str | None:
        return self.passed_flag("--reward_fn")

    @property
    def trust_remote_code(self) -> bool:
        """The steps' --trust_remote_code as given to every step: it also lets train.py read the sizes of models that
        ship their own code."""
        value = flag_value(self.extra_args, TRUST_REMOTE_CODE_FLAG)
        try:
            return value is not None and string_to_bool(value or "true")
        except ArgumentTypeError:
            raise UserError(f"{TRUST_REMOTE_CODE_FLAG} takes true or false (or no value), got {value!r}") from None

    def workload(self, reward_model: bool) -> Workload:
        """What step 3 will hold, for the planners; `reward_model`: whether its inputs resolved to one."""
        if self.algorithm == DPO:
            return Workload(critic=False, reward_model=False)
        algorithm = get_rl_algorithm(self.algorithm)
        estimator = self.passed_flag("--advantage_estimator") or algorithm.advantage_estimator
        samples = self.passed_flag("--n_samples_per_prompt")
        if samples is not None and not (samples.isdigit() and int(samples) > 0):
            raise UserError(f"--n_samples_per_prompt must be a positive whole number, got {samples!r}")
        return Workload(critic=get_advantage_estimator(estimator).needs_critic, reward_model=reward_model,
                        samples_per_prompt=int(samples) if samples else algorithm.n_samples_per_prompt,
                        verifiable_task=self.uses_default_task(3))

    def uses_default_task(self, step: int) -> bool:
        """A built-in verifier scores the answers and `step` is given no --data_path: it trains on the task."""
        reward_fn = self.reward_fn
        return reward_fn is not None and is_builtin(reward_fn) and self.passed_flag("--data_path", step) is None

    def step_flags(self, step: int) -> list[str]:
        """The flags train.py itself gives `step`: the algorithm to step 3, and, for a built-in verifier without
        --data_path, the embedded task it checks answers of to every step."""
        flags = ["--data_path", DEFAULT_TASK_DATA] if self.uses_default_task(step) else []
        if step == 3 and self.algorithm not in ("ppo", DPO):
            flags += ["--algorithm", self.algorithm]
        return flags

    def base_model(self, model: Model) -> str:
        return {Model.ACTOR: self.actor_model, Model.REWARD: self.reward_model}[model]

    def zero_stages(self) -> dict[Model, int | None]:
        return {Model.ACTOR: self.actor_zero_stage, Model.REWARD: self.reward_zero_stage}

    def run_dir(self, step: int) -> Path:
        return self.output_dir / STEPS[step].name

    def log_path(self, step: int) -> Path:
        return self.output_dir / "logs" / f"{STEPS[step].name}.log"


def args_field(spec: StepSpec) -> str:
    return f"{spec.name}_args"


def output_field(spec: StepSpec) -> str:
    return f"{spec.name}_output"


def _step_flags() -> type:
    taken = {source.from_step for spec in STEPS.values() for source in spec.inputs if source.from_step is not None}
    outputs = [
        (output_field(spec), str | None, field(default=None, metadata={
            "help": f"when step {spec.number} is not run: {spec.output.flag_help} "
                    f"(default: <output-dir>/{spec.name})"}))
        for spec in STEPS.values() if spec.number in taken
    ]
    args = [
        (args_field(spec), str | None, field(default=None, metadata={
            "metavar": "ARGS", "help": f"extra flags for step {spec.number} only, as one quoted string"}))
        for spec in STEPS.values()
    ]
    return make_dataclass("StepFlags", outputs + args)


StepFlags = _step_flags()
