"""DPO: the preference losses against hand-computed values, answer log-probs that skip prompt and
padding, and the step end to end on a tiny Llama (rewards 0 before training, a margin after, resume
after a crash, a bad loss name refused)."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from crash_resume import assert_same_weights
from shared_launch import built_once
from supervised_data import write_arithmetic_jsonl
from tiny_models import make_tiny_model_dir

from step2_reward.dpo.main import build_parser
from step2_reward.dpo.main import main as dpo_main
from step2_reward.dpo.objective import DPOObjective, answer_logprob_sums
from step2_reward.dpo.settings import DPOArguments
from training.algorithms import PREFERENCE_LOSSES, get_preference_loss
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.loops.metrics import read_metrics
from utils.data import PairwiseCollator
from utils.errors import EXIT_USER_ERROR, UserError, UserErrors

# three pairs, beta 0.5: log-ratios chosen [1, -1, 0], rejected [0, -1, -2], so h = [1, 0, 2]
POLICY_CHOSEN = torch.tensor([-4.0, -6.0, -3.0])
POLICY_REJECTED = torch.tensor([-5.0, -5.0, -8.0])
REFERENCE_CHOSEN = torch.tensor([-5.0, -5.0, -3.0])
REFERENCE_REJECTED = torch.tensor([-5.0, -4.0, -6.0])
H = (1.0, 0.0, 2.0)
BETA = 0.5


def _loss(name: str, label_smoothing: float = 0.0):
    config = SimpleNamespace(beta=BETA, label_smoothing=label_smoothing)
    return get_preference_loss(name)(POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, config)


def _softplus(x: float) -> float:
    """log(1 + e^x) = -log sigmoid(-x)."""
    return math.log1p(math.exp(x))


def test_registry_names_and_aggregation():
    assert PREFERENCE_LOSSES.names() == ["hinge", "ipo", "sigmoid"]
    assert [get_preference_loss(name).per_token_mean for name in ("hinge", "ipo", "sigmoid")] == [False, True, False]
    with pytest.raises(UserError, match="unknown preference loss 'kto'; choose one of: hinge, ipo, sigmoid"):
        get_preference_loss("kto")


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "hinge"])
def test_every_loss_returns_the_implicit_rewards(name):
    result = _loss(name)
    assert result.chosen_rewards.tolist() == [0.5, -0.5, 0.0]  # beta * (policy - reference), chosen
    assert result.rejected_rewards.tolist() == [0.0, -0.5, -1.0]
    assert not result.chosen_rewards.requires_grad


def test_sigmoid_loss_with_and_without_label_smoothing():
    # -log sigmoid(beta h) = log(1 + e^(-beta h))
    assert _loss("sigmoid").loss.item() == pytest.approx(sum(_softplus(-BETA * h) for h in H) / 3, rel=1e-6)
    smoothed = sum(0.9 * _softplus(-BETA * h) + 0.1 * _softplus(BETA * h) for h in H) / 3
    assert _loss("sigmoid", label_smoothing=0.1).loss.item() == pytest.approx(smoothed, rel=1e-6)


def test_ipo_and_hinge_losses():
    assert _loss("ipo").loss.item() == pytest.approx(2 / 3)  # (h - 1/(2 * 0.5))^2 = [0, 1, 1]
    assert _loss("hinge").loss.item() == pytest.approx(0.5)  # relu(1 - 0.5 h) = [0.5, 1, 0]


def test_the_loss_pushes_the_chosen_answer_up_and_the_rejected_down():
    policy_chosen, policy_rejected = POLICY_CHOSEN.clone().requires_grad_(), POLICY_REJECTED.clone().requires_grad_()
    config = SimpleNamespace(beta=BETA, label_smoothing=0.0)
    get_preference_loss("sigmoid")(policy_chosen, policy_rejected, REFERENCE_CHOSEN, REFERENCE_REJECTED, config).loss.backward()
    assert (policy_chosen.grad < 0).all() and (policy_rejected.grad > 0).all()
    assert torch.allclose(policy_chosen.grad, -policy_rejected.grad)


class FixedDistribution(torch.nn.Module):
    """A 'language model' that predicts the same distribution over 4 tokens at every position."""

    PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=self.PROBS.log().expand(*input_ids.shape, 4).clone())


def _pair_batch(items: list[tuple[list[int], list[int], int]], pad: int = 0) -> dict[str, torch.Tensor]:
    return PairwiseCollator(pad)([
        {"chosen_input_ids": torch.tensor(chosen), "chosen_attention_mask": torch.ones(len(chosen), dtype=torch.long),
         "rejected_input_ids": torch.tensor(rejected),
         "rejected_attention_mask": torch.ones(len(rejected), dtype=torch.long),
         "prompt_length": torch.tensor([prompt_length])}
        for chosen, rejected, prompt_length in items
    ])


def test_answer_logprobs_sum_the_answer_tokens_only():
    # pair 1: prompt [1, 2], chosen answer [3, 0], rejected answer [1]; pair 2: prompt [0], chosen answer [2],
    # rejected answer [3, 3, 3]; rows are padded to 4 with id 2, whose log-prob must not count
    batch = _pair_batch([([1, 2, 3, 0], [1, 2, 1], 2), ([0, 2], [0, 3, 3, 3], 1)], pad=2)
    sums, counts = answer_logprob_sums(FixedDistribution(), batch, tokenizer_size=None)
    p = FixedDistribution.PROBS.double().log()
    expected = [p[3] + p[0], p[2], p[1], 3 * p[3]]  # chosen 1, chosen 2, rejected 1, rejected 2
    assert counts.tolist() == [2, 1, 1, 3]
    assert sums.tolist() == pytest.approx([value.item() for value in expected], rel=1e-6)


def test_answer_logprobs_are_never_summed_without_the_tokenizers_size():
    """Left out, a policy with embedding rows beyond its tokenizer would be scored over every row, not over the ids it
    is sampled from: the size has no default (None, every row, is said outright)."""
    with pytest.raises(TypeError, match="tokenizer_size"):
        answer_logprob_sums(FixedDistribution(), _pair_batch([([1, 2, 3], [1, 2], 2)]))


def test_answer_logprobs_of_a_real_model_do_not_depend_on_padding(tmp_path):
    model = load_causal_lm(make_tiny_model_dir(tmp_path / "tiny", "llama")).eval()
    long, short = [5, 6, 7, 8, 9, 10], [5, 6, 7, 11]
    together, _ = answer_logprob_sums(model, _pair_batch([(long, short, 3)]), tokenizer_size=None)
    alone = [answer_logprob_sums(model, _pair_batch([(ids, ids, 3)]), tokenizer_size=None)[0][0]
             for ids in (long, short)]
    with torch.no_grad():
        logprobs = model(torch.tensor([long])).logits.log_softmax(-1)[0]
    by_hand = sum(logprobs[t - 1, long[t]] for t in range(3, len(long)))
    assert together[0].item() == pytest.approx(by_hand.item(), abs=1e-5)
    assert together.tolist() == pytest.approx([value.item() for value in alone], abs=1e-5)


def test_policy_equal_to_reference_gives_zero_rewards_and_log_2_loss(tmp_path):
    model = load_causal_lm(make_tiny_model_dir(tmp_path / "tiny", "llama")).eval()
    objective = DPOObjective(DPOArguments(beta=0.1))
    objective.reference = model
    result = objective.pair_loss(model, _pair_batch([([5, 6, 7], [5, 6, 8, 9], 2), ([4, 7, 7, 7], [4, 9], 1)]))
    assert result.chosen_rewards.tolist() == [0.0, 0.0] and result.rejected_rewards.tolist() == [0.0, 0.0]
    assert result.loss.item() == pytest.approx(math.log(2))
    assert objective.evaluate(model, [_pair_batch([([5, 6, 7], [5, 6, 8], 2)])])["accuracy"] == 0.0  # a tie is wrong


def test_a_policy_with_rows_beyond_its_tokenizer_is_compared_over_the_tokenizers_ids(tmp_path, monkeypatch):
    """A policy whose rows beyond the tokenizer hold nearly all of the whole distribution's mass (their logits made
    large on purpose) beside a reference that is the same model but for those rows: the two are one policy over the
    ids it is ever sampled from, so the implicit rewards are 0 (over every row they were several nats apart)."""
    from tiny_models import make_padded_vocab_model_dir

    from step2_reward.dpo import objective as dpo_objective

    policy = load_causal_lm(make_padded_vocab_model_dir(tmp_path / "policy", extra_row_scale=50.0)).eval()
    reference_dir = make_padded_vocab_model_dir(tmp_path / "reference")
    reference = load_causal_lm(reference_dir).eval()
    reference.destroy = lambda: None
    monkeypatch.setattr(dpo_objective, "create_reference_engine", lambda *args, **kwargs: reference)
    args = build_parser().parse_args(["--output_dir", str(tmp_path / "run"), "--model_name_or_path", reference_dir])
    objective = DPOObjective(DPOArguments(beta=1.0))
    with objective.reference_model(args, load_tokenizer(reference_dir)):
        result = objective.pair_loss(policy, _pair_batch([([5, 6, 7], [5, 6, 8, 9], 2), ([4, 7, 7, 7], [4, 9], 1)]))
    torch.testing.assert_close(torch.cat([result.chosen_rewards, result.rejected_rewards]), torch.zeros(4),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("flags, message", [
    (["--dpo_loss", "kto"], "unknown preference loss 'kto'; choose one of: hinge, ipo, sigmoid"),
    (["--dpo_beta", "0"], "--dpo_beta must be positive"),
    (["--dpo_loss", "ipo", "--dpo_label_smoothing", "0.1"], "applies to --dpo_loss sigmoid only"),
])
def test_bad_dpo_settings_are_user_errors(flags, message, tmp_path, capsys):
    with pytest.raises(UserError, match=message):
        build_parser().parse_args(["--output_dir", str(tmp_path / "run"), *flags]).dpo.preference_loss()
    with pytest.raises(SystemExit) as exited:
        dpo_main(["--output_dir", str(tmp_path / "run"), *flags])
    assert exited.value.code == EXIT_USER_ERROR and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_every_bad_dpo_setting_is_reported_at_once(tmp_path):
    """An unknown --dpo_loss, --dpo_beta 0 and a --dpo_label_smoothing out of range: each was told only once the one
    before it was fixed."""
    args = build_parser().parse_args(["--output_dir", str(tmp_path / "run"), "--dpo_loss", "kto", "--dpo_beta", "0",
                                      "--dpo_label_smoothing", "0.7"])
    with pytest.raises(UserErrors) as refused:
        args.dpo.preference_loss()
    assert [message.split(";")[0].split(",")[0] for message in refused.value.messages] == [
        "unknown preference loss 'kto'", "--dpo_beta must be positive", "--dpo_label_smoothing must be in [0"]


def test_dpo_flags_and_defaults(tmp_path):
    args = build_parser().parse_args(["--output_dir", str(tmp_path)])
    assert (args.dpo.beta, args.dpo.loss, args.dpo.label_smoothing) == (0.1, "sigmoid", 0.0)
    assert not args.dpo.offload_reference_model and args.training.learning_rate == 1e-6


# the step end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(request):
    """One set for the test run's workers (`built_once`), so that a test's run and `trained` read the same paths."""
    return built_once(request, "dpo_inputs", write_inputs)


def write_inputs(folder: Path) -> dict:
    return {
        "model": make_tiny_model_dir(folder / "tiny-llama", "llama"),
        "data": write_arithmetic_jsonl(folder / "pairs.jsonl", 48),
        "cache": str(folder / "cache"),
    }


def _argv(inputs, output_dir, *extra) -> list[str]:
    return ["--model_name_or_path", inputs["model"], "--data_path", inputs["data"], "--data_split", "1,2,0",
            "--eval_fraction", "0.25", "--data_output_path", inputs["cache"], "--output_dir", str(output_dir), "--dtype", "fp32",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_seq_len", "64",
            "--learning_rate", "1e-3", "--log_interval", "1", *extra]


@pytest.fixture(scope="module")
def trained(distributed, inputs, request):
    """A 2-epoch run's folder and summary, trained once for the test run's workers (`built_once`): read it only."""
    return built_once(request, "dpo_trained",
                      lambda folder: (folder / "run", dpo_main(_argv(inputs, folder / "run", "--num_train_epochs", "2"))))


def test_dpo_starts_at_zero_rewards_and_learns_the_preference(trained):
    run, summary = trained
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["step"] == "dpo" and summary["dpo_loss"] == "sigmoid" and summary["dpo_beta"] == 0.1
    # before training the policy is the reference: every implicit reward 0, so every pair a tie (wrong)
    assert summary["eval_accuracy_before"] == 0.0 and summary["eval_margin_before"] == 0.0
    assert summary["eval_loss_before"] == pytest.approx(math.log(2))
    assert summary["train_pairs"] == 24 and summary["eval_pairs"] == 8 and summary["optimizer_steps"] == 12
    assert summary["eval_accuracy_after"] == 1.0 and summary["eval_margin_after"] > 0.5
    assert summary["eval_chosen_reward_after"] > summary["eval_rejected_reward_after"]
    assert summary["eval_loss_after"] < 0.5 and summary["final_train_loss"] < math.log(2)
    evals = [record for record in read_metrics(run) if "eval/margin" in record]
    assert [record["step"] for record in evals] == [0, 6, 12]  # 24 pairs / batch 4 = 6 steps per epoch
    assert (run / "model" / "config.json").is_file() and load_tokenizer(str(run / "model")) is not None


def test_dpo_resumes_after_a_crash_with_the_uninterrupted_weights(trained, inputs, tmp_path, monkeypatch):
    reference_run, summary = trained
    argv = _argv(inputs, tmp_path / "run", "--num_train_epochs", "2", "--save_interval", "2")
    calls = {"count": 0, "crash_at": 5}  # micro-batch 5 is step 5: the last checkpoint is step 4's
    original_loss = DPOObjective.loss

    def counted_loss(self, policy, batch):
        calls["count"] += 1
        if calls["count"] == calls["crash_at"]:
            raise RuntimeError("simulated crash")
        return original_loss(self, policy, batch)

    monkeypatch.setattr(DPOObjective, "loss", counted_loss)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dpo_main(argv)
    assert not (tmp_path / "run" / "model").exists()
    calls.update(count=0, crash_at=None)
    resumed = dpo_main([*argv, "--resume"])
    assert calls["count"] == 12 - 4  # it continued from step 4 rather than starting over
    assert resumed["optimizer_steps"] == summary["optimizer_steps"] == 12
    assert resumed["eval_accuracy_before"] == 0.0  # the step-0 evaluation came back with the checkpoint
    assert resumed["eval_margin_after"] == pytest.approx(summary["eval_margin_after"], abs=1e-6)
    assert_same_weights(reference_run / "model", tmp_path / "run" / "model")


def test_dpo_warns_where_its_model_was_tuned_on_another_layout(trained, inputs, tmp_path, caplog):
    """Step 3 warned where its actor's run had tuned it under another --prompt_format, DPO did not: a DPO run from a
    model tuned under the tokenizer's chat template (auto) and given --prompt_format human_assistant trained policy and
    reference on pairs laid out as neither was tuned, silently."""
    run, _ = trained
    with caplog.at_level("WARNING", logger="training.reliability.layouts"):
        dpo_main(_argv({**inputs, "model": str(run)}, tmp_path / "run", "--max_steps", "1",
                       "--prompt_format", "human_assistant"))
    (warning,) = [record.getMessage() for record in caplog.records if record.name == "training.reliability.layouts"]
    assert f"the model {run} was tuned (--prompt_format auto)" in warning
    assert "but DPO lays them out as ' Human:" in warning and "Pass --prompt_format auto" in warning


def test_zero3_policy_and_reference_start_equal_and_train(distributed, inputs, tmp_path):
    summary = dpo_main(_argv(inputs, tmp_path / "run", "--zero_stage", "3", "--max_steps", "3", "--dpo_loss", "ipo"))
    assert summary["optimizer_steps"] == 3 and summary["dpo_loss"] == "ipo"
    assert summary["eval_margin_before"] == 0.0 and summary["eval_loss_before"] == pytest.approx(25.0)  # (0 - 5)^2
    assert summary["eval_margin_after"] > 0.0
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_the_policy_trains_without_dropout_so_it_starts_at_log_2(inputs, tmp_path):
    """GPT-2 has dropout 0.1 and the reference none: with dropout in the policy, the first step's loss (the policy
    still equal to the reference) was noise around log 2 (0.6876), and its gradient pushed on that noise."""
    model = make_tiny_model_dir(tmp_path / "tiny-gpt2", "gpt2")
    assert json.loads((tmp_path / "tiny-gpt2" / "config.json").read_text())["resid_pdrop"] > 0
    dpo_main(_argv({**inputs, "model": model, "cache": str(tmp_path / "cache")}, tmp_path / "run",
                   "--max_steps", "1", "--learning_rate", "1e-9", "--per_device_train_batch_size", "8"))
    first = next(record for record in read_metrics(tmp_path / "run") if "train/loss" in record)
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_the_reference_is_gone_before_the_final_save(inputs, tmp_path, monkeypatch):
    """The reference (a whole model, or its ZeRO-3 shards) is freed before the policy's full weights are gathered
    and written, the run's peak."""
    from step2_reward.dpo.main import dpo_step, parse_args
    from training.loops import supervised_step

    args = parse_args(_argv(inputs, tmp_path / "run", "--max_steps", "1"))
    objective = DPOObjective(args.dpo)
    seen = []
    save = supervised_step.save_hf_model
    monkeypatch.setattr(supervised_step, "save_hf_model",
                        lambda *a, **k: (seen.append(objective.reference), save(*a, **k))[1])
    supervised_step.run_supervised_step(args, dpo_step(objective))
    assert seen == [None]
