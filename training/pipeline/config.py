"""`train.py`'s own flags, each a dataclass field that HfArgumentParser turns into a `--dashed-flag`.

`PipelineConfig` holds the flags of the run as a whole; `StepFlags` the per-step ones the step registry
calls for (--NAME-args for every step, --NAME-output for every step whose output a later step takes).
"""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from training.core.model_loading import EMBEDDED_MODEL_NAME

from .deployment import DeploymentType, Model
from .steps import STEPS, StepSpec

_ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class PipelineConfig:
    step: list[int] = field(default_factory=lambda: list(STEPS), metadata={
        "choices": tuple(STEPS),
        "help": f"which steps to run, in order (default: {' '.join(str(number) for number in STEPS)})"})
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
        """The steps to run, in order, each once."""
        return sorted(set(self.step))

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
