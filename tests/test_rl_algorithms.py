"""Step 3's other algorithms on tiny models: K answers per prompt with group baselines, the KL as a loss
term, answers scored by a reward function (alone or added to the reward model), ReMax's greedy
baseline, and the step's entry point without a reward model or critic."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import recorded_step_gradients
from test_step3_rlhf import SetReward, assert_reward_rises, build_engine, make_step3_inputs, prompt_batch, step3_argv

from step3_rlhf.ppo_trainer import PPOConfig, PPOTrainer
from step3_rlhf.rlhf_engine import RLHFEngine
from training.algorithms import KL_ESTIMATORS, kl_loss, masked_mean
from training.core.sequences import answer_logprobs
from training.generation.generator import answer_mask_from_tokens, assemble_output
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_step3_inputs(tmp_path_factory)


def critic_free(engine: RLHFEngine, reward: torch.nn.Module | None = "keep") -> RLHFEngine:
    engine.critic.destroy()
    return RLHFEngine(engine.actor, engine.reference, None, engine.reward if reward == "keep" else reward,
                      engine.tokenizer)


def answer_length_bonus(prompt: str, answer: str, metadata) -> float:
    """A reward function for the tests: the row's bonus plus a tenth of the answer's characters."""
    return float(metadata.get("bonus", 0)) + len(answer) / 10


def test_grpo_answers_each_prompt_k_times_and_normalises_within_each_group(distributed, inputs):
    engine = critic_free(build_engine(inputs), reward=None)
    config = PPOConfig(algorithm="grpo", max_answer_seq_len=6, kl_ctl=0.5)
    trainer = PPOTrainer(engine, HybridEngine(engine.actor, HybridEngineSettings(enable=True)), config,
                         reward_fn=answer_length_bonus)
    prompts = prompt_batch(engine.tokenizer, 2)
    torch.manual_seed(0)
    experience = trainer.generate_experience({**prompts, "metadata": [{"bonus": 1}, {"bonus": 5}]})
    assert experience.batch_size == 8 and experience.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    P = experience.prompt_length
    assert torch.equal(experience.sequences[:, :P], prompts["input_ids"].repeat_interleave(4, 0))
    # every answer is scored with its prompt's metadata; the KL is a loss term, so the rewards are the score alone,
    # unclipped: --clip_reward_value bounds a reward model's score, not a reward function's (here above 5)
    bonus = experience.reward_fn_scores.floor()
    assert bonus.tolist() == [1.0] * 4 + [5.0] * 4
    last = experience.action_mask.sum(-1) - 1
    expected_rewards = torch.zeros_like(experience.rewards)
    expected_rewards[torch.arange(8), last] = experience.scores
    torch.testing.assert_close(experience.rewards, expected_rewards)
    scores = experience.scores.view(2, 4)
    normalised = ((scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)).flatten()
    torch.testing.assert_close(experience.advantages, normalised[:, None] * experience.action_mask)

    stats = trainer.train_rlhf(experience)
    k3 = masked_mean(KL_ESTIMATORS.get("k3")(experience.old_logprobs, experience.ref_logprobs), experience.action_mask)
    assert stats["kl_loss"] == pytest.approx(k3.item(), abs=1e-5)  # the first update starts at the rollout's policy
    assert "critic_loss" not in stats


def flat_gradient(loss: torch.Tensor, parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The gradient of `loss` in `parameters`, flattened into one vector (the graph is kept for another loss)."""
    return torch.cat([grad.flatten() for grad in torch.autograd.grad(loss, parameters, retain_graph=True)])


def test_grpos_kl_in_the_loss_moves_the_actor(distributed, inputs, monkeypatch):
    """With the KL as a loss term (GRPO's default), the actor's gradient is that of policy loss + kl_ctl * k3 KL
    to the reference, computed by hand at the rollout's weights, not the policy loss's alone."""
    from step3_rlhf import ppo_trainer

    gradients = recorded_step_gradients(monkeypatch, ppo_trainer)
    engine = critic_free(build_engine(inputs), reward=None)
    config = PPOConfig(algorithm="grpo", max_answer_seq_len=6, kl_ctl=0.5)
    trainer = PPOTrainer(engine, HybridEngine(engine.actor, HybridEngineSettings(enable=True)), config,
                         reward_fn=answer_length_bonus)
    torch.manual_seed(0)
    experience = trainer.generate_experience(prompt_batch(engine.tokenizer, 2))
    assert config.kl_in_loss and config.kl_estimator == "k3"

    parameters = [parameter for parameter in engine.actor.module.parameters() if parameter.requires_grad]
    logprobs = answer_logprobs(engine.actor.module, experience.sequences, experience.attention_mask,
                               experience.prompt_length, tokenizer_size=None)
    mask = trainer.loss_mask(experience.action_mask)
    policy = trainer.policy_loss(logprobs, experience.old_logprobs, experience.advantages, mask, config).loss
    kl = kl_loss(logprobs, experience.ref_logprobs, mask, "k3")
    policy_gradient, kl_gradient = flat_gradient(policy, parameters), flat_gradient(kl, parameters)
    assert kl_gradient.norm() > 0.1 * policy_gradient.norm()

    trainer.train_rlhf(experience)
    torch.testing.assert_close(gradients["actor"], policy_gradient + 0.5 * kl_gradient, atol=1e-5, rtol=1e-4)


def test_a_reward_function_is_added_to_the_reward_models_score_with_its_coefficient(distributed, inputs):
    engine = build_engine(inputs)
    eos = engine.tokenizer.eos_token_id
    answers = torch.tensor([[5, 6, eos], [7, eos, 0]])
    trainer = PPOTrainer(engine, FixedAnswers(answers, eos), PPOConfig(max_answer_seq_len=3), answer_length_bonus, 0.5)
    prompts = {**prompt_batch(engine.tokenizer, 2), "metadata": [{"bonus": 2}, {}]}
    experience = trainer.generate_experience(prompts)
    with torch.no_grad():
        model_scores = engine.reward(input_ids=experience.sequences,
                                     attention_mask=experience.attention_mask)["end_scores"].float()
    texts = [engine.tokenizer.decode(row, skip_special_tokens=True) for row in ([5, 6, eos], [7, eos])]
    function = torch.tensor([2 + len(texts[0]) / 10, len(texts[1]) / 10])
    torch.testing.assert_close(experience.reward_fn_scores, function)
    torch.testing.assert_close(experience.scores, model_scores + 0.5 * function, atol=1e-5, rtol=0)


class FixedAnswers:
    """Scripted answers: `sampled` when sampling (K rows per prompt as asked), `greedy` for greedy decoding."""

    def __init__(self, sampled: torch.Tensor, eos: int, greedy: torch.Tensor | None = None):
        self.sampled, self.greedy, self.eos = sampled, greedy, eos

    def generate(self, input_ids, attention_mask, config):
        answers = self.sampled if config.do_sample or self.greedy is None else self.greedy
        rows = config.num_return_sequences
        input_ids, attention_mask = input_ids.repeat_interleave(rows, 0), attention_mask.repeat_interleave(rows, 0)
        return assemble_output(input_ids, attention_mask, answers, torch.zeros(answers.shape),
                               answer_mask_from_tokens(answers, self.eos), config.pad_token_id)


def test_remax_subtracts_the_score_of_each_prompts_greedy_answer(distributed, inputs):
    engine = critic_free(build_engine(inputs), reward=None)
    eos = engine.tokenizer.eos_token_id
    sampled = torch.tensor([[5, 6, 7, eos], [8, eos, 0, 0]])
    greedy = torch.tensor([[9, 10, eos], [11, 12, 13]])  # row 1 never ends: it pays the no-EOS penalty too
    config = PPOConfig(algorithm="remax", max_answer_seq_len=4, kl_ctl=0.0, no_eos_penalty=0.25)
    trainer = PPOTrainer(engine, FixedAnswers(sampled, eos, greedy), config, answer_length_bonus)
    experience = trainer.generate_experience(prompt_batch(engine.tokenizer, 2))
    decode = engine.tokenizer.decode
    baseline = torch.tensor([len(decode([9, 10, eos], skip_special_tokens=True)) / 10,
                             len(decode([11, 12, 13], skip_special_tokens=True)) / 10 - 0.25])
    expected = (experience.scores - baseline)[:, None] * experience.action_mask
    torch.testing.assert_close(experience.advantages, expected)


def test_remax_gathers_the_actor_once_for_its_sampled_and_greedy_answers(distributed, inputs):
    """The sampled and the greedy generate each entered generate mode: two ZeRO-3 gathers and inference copies a
    rollout, the design's "weights gathered once per rollout" broken."""
    engine = critic_free(build_engine(inputs), reward=None)
    hybrid = HybridEngine(engine.actor, HybridEngineSettings(enable=True))
    entries = []
    enter = hybrid._enter
    hybrid._enter = lambda stack: (entries.append(1), enter(stack))[1]
    config = PPOConfig(algorithm="remax", max_answer_seq_len=4)
    experience = PPOTrainer(engine, hybrid, config, answer_length_bonus).generate_experience(
        prompt_batch(engine.tokenizer, 2))
    assert len(entries) == 1 and experience.scores.shape == (2,)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_a_group_algorithm_raises_a_rule_based_reward(distributed, inputs, algorithm):
    tokenizer = build_engine(inputs).tokenizer
    prompts = prompt_batch(tokenizer, 4)
    chosen = torch.arange(0, len(tokenizer), 2)  # reward: share of answer tokens with an even id
    engine = critic_free(build_engine(inputs, lr=5e-3), reward=SetReward(chosen, prompts["input_ids"].shape[1]))
    trainer = PPOTrainer(engine, HybridEngine(engine.actor, HybridEngineSettings(enable=True)),
                         PPOConfig(algorithm=algorithm, max_answer_seq_len=6, kl_ctl=0.01))
    assert_reward_rises(trainer, prompts, steps=20, epochs=2, micro_batch=8, window=4)


def test_bad_algorithm_settings_are_refused_before_anything_loads(distributed, inputs, tmp_path):
    from step3_rlhf.main import main

    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        main(step3_argv(inputs, run, "--algorithm", "rloo", "--n_samples_per_prompt", "1"))
    argv = [arg for arg in step3_argv(inputs, run) if arg not in ("--critic_model_name_or_path", inputs["reward"])]
    with pytest.raises(SystemExit):
        main([*argv, "--algorithm", "grpo"])
    with pytest.raises(SystemExit):
        main([*argv, "--algorithm", "grpo", "--reward_fn", "no_such_module_xyz:score"])
    assert not run.exists()


def test_grpo_with_a_reward_function_runs_without_reward_model_or_critic(distributed, inputs, tmp_path):
    from step3_rlhf.main import main

    scorer = tmp_path / "scorer.py"
    scorer.write_text("def score(prompt, answer, metadata):\n    return float(len(answer) % 3)\n")
    run = tmp_path / "run"
    argv = [arg for arg in step3_argv(inputs, run) if arg not in ("--critic_model_name_or_path", inputs["reward"])]
    summary = main([*argv, "--algorithm", "grpo", "--reward_fn", f"{scorer}:score", "--max_steps", "2",
                    "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "8",
                    "--enable_hybrid_engine"])
    assert summary["algorithm"] == "grpo" and summary["ppo_steps"] == 2 and summary["critic_dir"] is None
    assert summary["reward_fn_first"] is not None and summary["reward_fn_last"] is not None
    assert not (run / "critic").exists() and (run / "actor" / "config.json").is_file()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/fn_mean" in row for row in metrics) and any("train/kl_loss" in row for row in metrics)
    args = json.loads((run / "args.json").read_text())
    assert (args["n_samples_per_prompt"], args["kl_in_loss"], args["advantage_estimator"]) == (4, True,
                                                                                             "group_normalized")


def test_the_held_out_evaluation_scores_the_same_prompts_whatever_the_batch_size(distributed, inputs):
    from step3_rlhf.run_loop import evaluate
    from training.generation.generator import HFGenerator
    from training.loops.batch_stream import BatchStream
    from utils.data import PromptCollator, TokenizedDataset

    engine = build_engine(inputs)
    tokenizer = engine.tokenizer
    prompts = [f"Human: What is {i} plus {i + 1}? Assistant:" for i in range(7)]
    dataset = TokenizedDataset.from_lists({"input_ids": tokenizer(prompts)["input_ids"]})
    trainer = PPOTrainer(engine, HFGenerator(engine.actor), PPOConfig(max_answer_seq_len=4))
    results = []
    for batch_size in (2, 5):  # 5 prompts: three batches of 2 (the last cut to 1), or one of 5
        stream = BatchStream(dataset, batch_size, PromptCollator(tokenizer.pad_token_id), seed=0, shuffle=False)
        results.append(evaluate(trainer, stream, 5))
    assert results[0]["score_mean"] == pytest.approx(results[1]["score_mean"], abs=1e-5)
    assert results[0]["response_length"] == pytest.approx(results[1]["response_length"], abs=1e-6)
