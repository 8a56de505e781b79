"""Step-3 flags that do nothing in the combination given are refused from the flags alone, naming the flag, why it does
nothing and what to do; the defaults, the valid combinations and train.py's plans still pass."""
import re

import pytest

from step3_rlhf.main import parse_args
from step3_rlhf.unused_flags import check_unused_flags
from training.algorithms import VALUE_LOSSES, clipped_value_loss
from training.pipeline.deployment import DeploymentType, ModelSizes, Workload
from training.pipeline.hardware import Hardware, ModelSize
from training.pipeline.planning import plan_cpu, plan_gpu
from utils.errors import UserError

REWARD_MODEL = ["--critic_model_name_or_path", "reward"]
REWARD_FN = ["--reward_fn", "builtin:math"]
CRITIC_FREE = ("grpo", "rloo", "reinforce_pp", "remax")


def settings(*flags: str, scorer: list[str] = REWARD_MODEL):
    return parse_args(["--actor_model_name_or_path", "actor", "--output_dir", "run", *scorer, *flags])


def refused(*flags: str, scorer: list[str] = REWARD_MODEL) -> str:
    with pytest.raises(UserError) as error:
        check_unused_flags(settings(*flags, scorer=scorer))
    return str(error.value)


@pytest.mark.parametrize("algorithm", CRITIC_FREE)
def test_a_critic_flag_under_a_critic_free_algorithm_is_refused(algorithm):
    """The critic's learning rate, LoRA, offload, ... were taken and never used: these algorithms build no critic."""
    message = refused("--algorithm", algorithm, "--critic_learning_rate", "1e-4")
    assert message.startswith("--critic_learning_rate 0.0001 does nothing here: advantage estimator")
    assert f"(--algorithm {algorithm}) trains no critic; use an algorithm with one (--algorithm ppo), or drop it" in message
    check_unused_flags(settings("--critic_learning_rate", "1e-4"))


@pytest.mark.parametrize("flags, named", [
    (["--critic_weight_decay", "0.1"], "--critic_weight_decay 0.1"), (["--critic_lora_dim", "4"], "--critic_lora_dim 4"),
    (["--critic_lora_module_name", "h."], "--critic_lora_module_name h."),
    (["--critic_offload", "--critic_zero_stage", "2"], "--critic_offload"),  # the stage builds the reward model too
    (["--critic_gradient_checkpointing"], "--critic_gradient_checkpointing"),
    (["--cliprange_value", "0.3"], "--cliprange_value 0.3"), (["--value_loss", "huber"], "--value_loss huber")])
def test_every_critic_flag_is_refused_without_a_critic(flags, named, monkeypatch):
    monkeypatch.setitem(VALUE_LOSSES.entries, "huber", clipped_value_loss)  # a second value loss to choose
    assert refused("--algorithm", "grpo", *flags).startswith(f"{named} does nothing here: advantage estimator "
                                                             "'group_normalized' (--algorithm grpo) trains no critic")
    check_unused_flags(settings(*flags))


def test_the_critic_lora_flags_are_named_together():
    message = refused("--algorithm", "rloo", "--critic_lora_dim", "4", "--critic_only_optimize_lora",
                      "--critic_lora_learning_rate", "1e-3")
    assert message.startswith("--critic_lora_dim 4 and --critic_only_optimize_lora and --critic_lora_learning_rate "
                              "0.001 do nothing here") and message.endswith("or drop them")


def test_the_critic_zero_stage_is_refused_only_without_a_reward_model_too():
    """It also builds the frozen reward model (ZeRO-3 at 3, as DeepSpeed-Chat's), so a critic-free run with a reward
    model keeps it."""
    message = refused("--algorithm", "grpo", "--critic_zero_stage", "3", scorer=REWARD_FN)
    assert message.startswith("--critic_zero_stage 3 does nothing here: it sets the ZeRO stage of the critic and the "
                              "reward model, and the run has neither")
    check_unused_flags(settings("--algorithm", "grpo", "--critic_zero_stage", "3"))
    check_unused_flags(settings("--critic_zero_stage", "3", scorer=REWARD_FN))  # ppo's critic from the actor


@pytest.mark.parametrize("flag, named", [(["--offload_reward_model"], "--offload_reward_model"),
                                         (["--clip_reward_value", "1"], "--clip_reward_value 1.0")])
def test_a_reward_model_flag_without_a_reward_model_is_refused(flag, named):
    """--clip_reward_value bounds the reward model's score alone (83338e2): with --reward_fn alone it clipped a 0."""
    message = refused("--algorithm", "grpo", *flag, scorer=REWARD_FN)
    assert message == (f"{named} does nothing here: no reward model scores the answers (--reward_fn "
                       "alone); give one with --critic_model_name_or_path (a step-2 run folder), or drop it")
    check_unused_flags(settings("--algorithm", "grpo", *flag))


def test_a_reward_function_weight_without_a_reward_function_is_refused():
    assert "it weighs --reward_fn, which is not given; add --reward_fn" in refused("--reward_fn_coef", "0.5")
    check_unused_flags(settings("--reward_fn_coef", "0.5", *REWARD_FN))


@pytest.mark.parametrize("flag, value, unread_by, read_by, readers", [
    ("--lam", "0.9", "grpo", "ppo", "gae"),
    ("--gamma", "0.99", "rloo", "reinforce_pp", "gae, reinforce_pp"),
    ("--group_std_eps", "0.001", "ppo", "grpo", "group_normalized")])
def test_an_estimator_constant_the_estimator_does_not_read_is_refused(flag, value, unread_by, read_by, readers):
    message = refused("--algorithm", unread_by, flag, value)
    assert re.search(rf"^{flag} {value} does nothing here: advantage estimator '\w+' \(--algorithm {unread_by}\) does "
                     rf"not read it; the estimators that do: {readers}, or drop it$", message), message
    check_unused_flags(settings("--algorithm", read_by, flag, value))


def test_turning_off_whitening_an_estimator_does_not_do_is_refused():
    message = refused("--algorithm", "remax", "--disable_advantage_whitening")
    assert "(--algorithm remax) does not whiten its advantages; the estimators that do: gae, reinforce_pp" in message
    check_unused_flags(settings("--algorithm", "reinforce_pp", "--disable_advantage_whitening"))


def test_an_adaptation_horizon_without_an_adaptive_kl_coefficient_is_refused():
    assert "without --target_kl the coefficient stays --kl_ctl; add --target_kl" in refused("--kl_horizon", "100")
    check_unused_flags(settings("--kl_horizon", "100", "--target_kl", "0.5"))


@pytest.mark.parametrize("flags, named", [
    (["--kl_estimator", "k3"], "--kl_estimator k3"), (["--kl_in_loss"], "--kl_in_loss"),
    (["--algorithm", "grpo", "--kl_in_loss", "false"], "--kl_in_loss false"),
    (["--algorithm", "grpo", "--kl_estimator", "k2"], "--kl_estimator k2")])
def test_a_kl_estimator_or_place_without_a_kl_coefficient_is_refused(flags, named):
    """At --kl_ctl 0 the KL weighs nothing wherever it is and however estimated: they changed only the logged kl_loss."""
    assert refused(*flags, "--kl_ctl", "0").startswith(f"{named} does nothing here: with --kl_ctl 0 the KL to the "
                                                       "reference weighs nothing")
    check_unused_flags(settings(*flags))


@pytest.mark.parametrize("algorithm", ("ppo", *CRITIC_FREE))
def test_the_algorithms_own_kl_estimator_and_place_pass_without_a_kl_coefficient(algorithm):
    """GRPO without KL (--kl_ctl 0) is a recipe of its own; its KL settings are the algorithm's, not given."""
    check_unused_flags(settings("--algorithm", algorithm, "--kl_ctl", "0"))
    check_unused_flags(settings("--algorithm", algorithm, "--kl_ctl", "0", "--kl_estimator",
                                settings("--algorithm", algorithm).ppo.kl_estimator))


def test_an_ema_decay_without_the_ema_is_refused():
    assert refused("--ema_beta", "0.9") == ("--ema_beta 0.9 does nothing here: no EMA of the actor is kept without "
                                            "--enable_ema; add --enable_ema, or drop it")
    check_unused_flags(settings("--ema_beta", "0.9", "--enable_ema"))


@pytest.mark.parametrize("flags", [
    ["--inference_tp_size", "2"], ["--tp_gather_partition_size", "4"], ["--release_inference_cache"],
    ["--keep_inference_copy"], ["--unpin_actor_parameters"], ["--disable_fused_decode"], ["--disable_cuda_graph"],
    ["--disable_onednn_packing"], ["--generation_dtype", "bf16"]])
def test_a_hybrid_engine_flag_without_the_hybrid_engine_is_refused(flags):
    """transformers' generate (the 'hf' backend) ignores every one of them."""
    message = refused(*flags)
    assert message.startswith(f"{' '.join(flags)} does nothing here: it configures the hybrid engine's generation")
    assert message.endswith("which ignores it; add --enable_hybrid_engine, or drop it")
    overridden = refused("--enable_hybrid_engine", "--generation_backend", "hf", *flags)
    assert overridden.endswith("which ignores it; drop --generation_backend hf, or drop it")
    check_unused_flags(settings("--enable_hybrid_engine", "--actor_zero_stage", "3", *flags))


@pytest.mark.parametrize("flags", [
    ["--tp_gather_partition_size", "4"], ["--disable_fused_decode"], ["--disable_cuda_graph"],
    ["--disable_onednn_packing"], ["--generation_dtype", "bf16"]])
def test_an_inference_copy_flag_with_unpinned_parameters_is_refused(flags):
    """Unpinned, the actor's own module generates: no inference copy is gathered, fused, graphed, packed or cast."""
    unpinned = ["--enable_hybrid_engine", "--actor_zero_stage", "3", "--unpin_actor_parameters"]
    assert refused(*unpinned, *flags) == (
        f"{' '.join(flags)} does nothing here: it configures the hybrid engine's inference copy, and with "
        "--unpin_actor_parameters none is built (the actor's own module generates through its ZeRO-3 hooks); drop "
        "--unpin_actor_parameters, or drop it")
    check_unused_flags(settings(*unpinned, "--release_inference_cache"))  # the KV cache is still the engine's


def test_a_gather_group_size_below_zero_3_is_refused():
    """Below ZeRO-3 every rank holds the whole actor: the inference copy gathers nothing, in groups of any size."""
    assert refused("--enable_hybrid_engine", "--actor_zero_stage", "2", "--tp_gather_partition_size", "2") == (
        "--tp_gather_partition_size 2 does nothing here: it bounds the decoder layers gathered at once from a ZeRO-3 "
        "actor, and at --actor_zero_stage 2 every rank holds the whole actor (nothing is gathered); use "
        "--actor_zero_stage 3, or drop it")
    check_unused_flags(settings("--enable_hybrid_engine", "--actor_zero_stage", "3", "--tp_gather_partition_size", "2"))
    check_unused_flags(settings("--enable_hybrid_engine", "--placement", "auto", "--tp_gather_partition_size", "2"))


@pytest.mark.parametrize("flags", [
    ["--unsup_coef", "0.1"], ["--unsupervised_dataset_config_name", "wikitext-2-raw-v1"],
    ["--unsupervised_text_column", "content"]])
def test_a_pretraining_mixture_flag_without_a_source_is_refused(flags):
    assert refused(*flags) == (f"{' '.join(flags)} does nothing here: no pretraining text is mixed in without "
                               "--unsupervised_dataset_name; add it (e.g. --unsupervised_dataset_name embedded), or "
                               "drop it")
    check_unused_flags(settings("--unsupervised_dataset_name", "embedded", *flags))


def test_a_stage_fusion_micro_batch_without_stage_fusion_is_refused():
    assert "without --enable_stage_fusion; add --enable_stage_fusion" in refused("--stage_fusion_micro_batch_size", "0")
    with pytest.raises(UserError, match="--stage_fusion_micro_batch_size must be at least 1, got 0"):
        settings("--stage_fusion_micro_batch_size", "0", "--enable_stage_fusion", "--enable_hybrid_engine").check_flags(1)
    check_unused_flags(settings("--stage_fusion_micro_batch_size", "4", "--enable_stage_fusion"))
    check_unused_flags(settings("--stage_fusion_micro_batch_size", "4", "--placement", "auto"))  # its plan may fuse


@pytest.mark.parametrize("flags", [["--hardware_file", "a100-80gb"], ["--calibrate"]])
def test_the_planners_machine_flags_without_the_planner_are_refused(flags):
    assert refused("--placement", "interleave", *flags).startswith(
        f"{' '.join(flags)} does nothing here: only --placement auto plans with the machine's constants, and "
        "--placement interleave places the models as named; use --placement auto")
    check_unused_flags(settings("--placement", "auto", *flags))


@pytest.mark.parametrize("algorithm", ("ppo", *CRITIC_FREE))
@pytest.mark.parametrize("scorer", [REWARD_MODEL, REWARD_FN, REWARD_MODEL + REWARD_FN])
def test_the_defaults_of_every_algorithm_and_scorer_pass(algorithm, scorer):
    check_unused_flags(settings("--algorithm", algorithm, scorer=scorer))


def test_the_flag_checks_refuse_them():
    """`Step3Settings.check_flags`, which step 3 and train.py run before anything loads, includes these checks."""
    with pytest.raises(UserError, match="--ema_beta 0.9 does nothing here"):
        settings("--ema_beta", "0.9").check_flags(1)


SMALL = ModelSize(parameters=135_000_000, hidden_size=576, num_layers=30, vocab_size=49152)
B7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
TWO_CORES = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=True)
LAPTOP_GPU = Hardware(num_gpus=1, gpu_memory_gib=24, cpu_memory_gib=64, cpu_cores=8, bf16=True)


@pytest.mark.parametrize("algorithm, reward_model", [("ppo", True), ("grpo", True), ("grpo", False), ("rloo", False)])
@pytest.mark.parametrize("deployment", ["cpu", "gpu"])
def test_train_pys_step3_plans_set_no_flag_without_effect(algorithm, reward_model, deployment):
    """The GPU plan gave a critic-free step 3 the critic's ZeRO stage, offload, LoRA and checkpointing, which it
    would now refuse: it plans them only for a run with a critic (and the ZeRO stage for one with a reward model)."""
    workload = Workload(critic=algorithm == "ppo", reward_model=reward_model,
                        samples_per_prompt=1 if algorithm == "ppo" else 4)
    sizes = ModelSizes(B7, SMALL)
    plan = plan_cpu(sizes, TWO_CORES, workload=workload) if deployment == "cpu" else \
        plan_gpu(DeploymentType.SINGLE_GPU, sizes, LAPTOP_GPU, None, workload=workload)
    scorer = (REWARD_MODEL if reward_model else []) + ([] if algorithm == "ppo" and reward_model else REWARD_FN)
    check_unused_flags(settings("--algorithm", algorithm, *plan.steps[3].argv(), scorer=scorer))


def test_train_pys_reward_zero_stage_reaches_a_step3_critic_or_reward_model_only():
    """--reward-zero-stage set step 3's --critic_zero_stage even where it builds neither a critic nor a reward model."""
    from training.pipeline.deployment import Model
    from training.pipeline.planning import apply_zero_overrides

    for critic, reward_model, given in ((True, False, True), (False, True, True), (False, False, False)):
        plan = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES,
                        workload=Workload(critic=critic, reward_model=reward_model, samples_per_prompt=4))
        untaken = apply_zero_overrides(plan, {Model.ACTOR: None, Model.REWARD: 2}, steps=(3,))
        assert plan.steps[3].flags.get("critic_zero_stage") == (2 if given else None)
        assert untaken == (set() if given else {Model.REWARD}), "train.py refuses a stage no step takes"
