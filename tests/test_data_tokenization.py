"""Prompt rendering, per-phase tokenisation rules, collators."""
import pytest
import torch
from tiny_models import make_tokenizer

from utils.data import (
    IGNORE_INDEX,
    PairwiseCollator,
    PromptCollator,
    PromptFormatter,
    SFTCollator,
    TokenizedDataset,
)
from utils.data.samples import KIND_PAIRS, KIND_PROMPTS, KIND_SFT, Sample
from utils.data.tokenization import TokenLimits, tokenize_samples
from utils.errors import UserError

TURNS = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Tell me a joke"})


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(chat_template=True, with_pad=True)


@pytest.fixture(scope="module")
def plain_tok():
    return make_tokenizer(chat_template=False, with_pad=True)


def test_chat_template_renders_all_turns_with_generation_prompt(chat_tok):
    formatter = PromptFormatter(chat_tok, "auto")
    assert formatter.style == "chat_template"
    row = formatter.row(Sample(TURNS, "Why?", "No."))
    assert row["prompt"] == chat_tok.apply_chat_template(list(TURNS), tokenize=False, add_generation_prompt=True)
    assert row["prompt"].count("<|im_start|>user") == 2 and row["prompt"].endswith("<|im_start|>assistant\n")
    assert (row["chosen"], row["rejected"]) == ("Why?", "No.")


LLAMA2_STYLE = ("{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
                "{% else %} {{ message['content'] }} <|im_end|>{% endif %}{% endfor %}")
TURN_END_STYLE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                  "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWRITING_STYLE = ("{% for message in messages %}{% if loop.last and message['role'] == 'assistant' %}ANSWER: "
                   "{% endif %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("template, chosen, sft_text", [
    (LLAMA2_STYLE, " Why? ", "[INST] Hi [/INST] Hello <|im_end|>[INST] Tell me a joke [/INST] Why? <|im_end|>"),
    (TURN_END_STYLE, "Why?<|endoftext|>",
     "<|im_start|>user\nHi<|endoftext|>\n<|im_start|>assistant\nHello<|endoftext|>\n<|im_start|>user\nTell me a joke"
     "<|endoftext|>\n<|im_start|>assistant\nWhy?<|endoftext|>"),
    (REWRITING_STYLE, "Why?", "user: Hi\nassistant: Hello\nuser: Tell me a joke\nassistant:Why?<|im_end|>"),
])
def test_a_reply_is_written_as_the_chat_template_writes_it_after_the_prompt(template, chosen, sft_text):
    """A template that decorates replies (Llama-2's spaces) trains on its decorated reply; one whose turns end in
    another special token than the EOS (Gemma's <end_of_turn>) ends the answer at that token, with neither what it
    writes after it nor an EOS: the model then learns to end its turn as it is served, where step 3's generation
    stops, and step 2 scores the sequence at that token (step 1 trained on "Why?<|endoftext|>\n<|im_end|>": an EOS
    that a model served as its template ends its turn never reaches); one that renders the conversation otherwise
    than prompt + reply (it rewrites the last turn) takes the reply as it is."""
    tokenizer = make_tokenizer(chat_template=False, with_pad=True)
    tokenizer.chat_template = template
    formatter = PromptFormatter(tokenizer, "chat_template")
    sample = Sample(TURNS, "Why?", "No.")
    row = formatter.row(sample)
    assert row["chosen"] == chosen
    (item,) = tokenize_samples([sample], KIND_SFT, formatter, tokenizer, TokenLimits(max_seq_len=200))
    assert tokenizer.decode(item["input_ids"]) == sft_text


@pytest.mark.parametrize("template", [LLAMA2_STYLE, None])
def test_a_reply_that_holds_the_eos_text_is_kept_whole(chat_tok, template):
    """The reply ended at the first EOS text in what the template wrote: one that quotes it (ChatML's <|im_end|>,
    or Llama-2's </s> closing an HTML <s> tag) was cut there, and trained to end after its first half."""
    tokenizer = make_tokenizer(chat_template=False, with_pad=True)
    tokenizer.chat_template = template or chat_tok.chat_template
    reply = "In ChatML each turn ends in <|im_end|> and the next starts with <|im_start|>. That is all."
    row = PromptFormatter(tokenizer, "chat_template").row(Sample(TURNS, reply, "No."))
    assert row["chosen"] == (f" {reply} " if template else reply) and row["rejected"].strip() == "No."


def test_fallback_is_deepspeed_chat_human_assistant(plain_tok, chat_tok):
    for formatter in (PromptFormatter(plain_tok, "auto"), PromptFormatter(chat_tok, "human_assistant"), PromptFormatter(None)):
        row = formatter.row(Sample(TURNS, "Why?"))
        assert row["prompt"] == " Human: Hi Assistant: Hello Human: Tell me a joke Assistant:"
        assert row["chosen"] == " Why?" and row["rejected"] is None
    with pytest.raises(UserError, match="chat template"):
        PromptFormatter(plain_tok, "chat_template")
    with pytest.raises(UserError, match="unknown prompt format"):
        PromptFormatter(plain_tok, "alpaca")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_sft_masks_prompt_and_appends_eos(chat_tok):
    formatter = PromptFormatter(chat_tok)
    sample = Sample(TURNS, "Why did the chicken cross the road?")
    (item,) = tokenize_samples([sample], KIND_SFT, formatter, chat_tok, TokenLimits(max_seq_len=200))
    prompt = _ids(chat_tok, formatter.prompt(TURNS))
    answer = _ids(chat_tok, sample.chosen)
    assert item["input_ids"].tolist() == prompt + answer + [chat_tok.eos_token_id]
    assert item["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + answer + [chat_tok.eos_token_id]
    assert item["attention_mask"].tolist() == [1] * len(item["input_ids"])
    (whole,) = tokenize_samples([sample], KIND_SFT, formatter, chat_tok, TokenLimits(200, whole_sequence_loss=True))
    assert whole["labels"].tolist() == whole["input_ids"].tolist()


def test_sft_truncates_the_answer_and_drops_overlong_prompts(chat_tok):
    formatter = PromptFormatter(chat_tok)
    prompt_len = len(_ids(chat_tok, formatter.prompt(TURNS)))
    long_turns = ({"role": "user", "content": "fox " * 200},)
    data = tokenize_samples([Sample(TURNS, "word " * 100), Sample(long_turns, "ok")], KIND_SFT, formatter, chat_tok,
                            TokenLimits(max_seq_len=prompt_len + 5))
    assert data.stats == {"items": 1, "dropped:prompt_too_long": 1, "answer_truncated": 1}
    item = data[0]
    assert len(item["input_ids"]) == prompt_len + 5
    assert (item["labels"] != IGNORE_INDEX).sum() == 5
    assert item["input_ids"][-1] != chat_tok.eos_token_id


def test_pairs_append_eos_truncate_and_drop_identical(plain_tok):
    formatter = PromptFormatter(plain_tok)
    samples = [Sample(TURNS, "yes good", "no bad"), Sample(TURNS, "same start then A", "same start then B")]
    prompt_len = len(plain_tok(formatter.prompt(TURNS))["input_ids"])
    data = tokenize_samples(samples, KIND_PAIRS, formatter, plain_tok, TokenLimits(max_seq_len=prompt_len + 40))
    assert len(data) == 2
    assert data[0]["chosen_input_ids"][-1] == plain_tok.eos_token_id == data[0]["rejected_input_ids"][-1]
    assert plain_tok.decode(data[0]["chosen_input_ids"][prompt_len:-1]) == " yes good"
    assert [item["prompt_length"].tolist() for item in data] == [[prompt_len], [prompt_len]]
    cut = tokenize_samples(samples, KIND_PAIRS, formatter, plain_tok, TokenLimits(max_seq_len=prompt_len + 2))
    assert cut.stats["dropped:identical_after_truncation"] == 1
    assert len(cut) == 1 and len(cut[0]["chosen_input_ids"]) == prompt_len + 2


def test_items_whose_answer_is_cut_at_max_seq_len_are_counted(plain_tok):
    """A pair or SFT item cut at --max_seq_len (its EOS with it) was kept without a word: 15% of hh-rlhf's harmless
    pairs at 256 tokens under SmolLM2's tokenizer."""
    formatter = PromptFormatter(plain_tok)
    samples = [Sample(TURNS, "yes good", "no"), Sample(TURNS, "a much longer answer than that", "no")]
    prompt_len = len(plain_tok(formatter.prompt(TURNS))["input_ids"])
    row = formatter.row(samples[0])
    whole = len(plain_tok(row["prompt"] + row["chosen"])["input_ids"]) + len(formatter.answer_suffix_ids)  # EOS
    for kind in (KIND_PAIRS, KIND_SFT):
        fits = tokenize_samples(samples[:1], kind, formatter, plain_tok, TokenLimits(max_seq_len=whole))
        assert fits.stats == {"items": 1} and fits[0][next(iter(fits[0]))][-1] == plain_tok.eos_token_id
        cut = tokenize_samples(samples, kind, formatter, plain_tok, TokenLimits(max_seq_len=whole))
        assert cut.stats == {"items": 2, "answer_truncated": 1}, kind
        assert cut.answers_cut == 1 and TokenizedDataset.from_state(cut.state()).answers_cut == 1
        assert cut.head(1).answers_cut == 0, "the item the step leaves out is not counted against the one it uses"
        assert cut.head(2).answers_cut == 1
    assert whole > prompt_len + 1


def test_prompts_drop_or_left_truncate_overlong(chat_tok):
    formatter = PromptFormatter(chat_tok)
    short = Sample(({"role": "user", "content": "Hi"},))
    long = Sample(TURNS + ({"role": "assistant", "content": "fox " * 30}, {"role": "user", "content": "End now"}))
    limit = len(_ids(chat_tok, formatter.prompt(short.turns))) + 3
    dropped = tokenize_samples([short, long], KIND_PROMPTS, formatter, chat_tok, TokenLimits(64, limit))
    assert dropped.stats == {"items": 1, "dropped:prompt_too_long": 1}
    kept = tokenize_samples([short, long], KIND_PROMPTS, formatter, chat_tok, TokenLimits(64, limit, "left_truncate"))
    assert kept.stats == {"items": 2, "left_truncated": 1}
    full = _ids(chat_tok, formatter.prompt(long.turns))
    assert full[0] == chat_tok.bos_token_id and full.count(chat_tok.bos_token_id) > 1  # it opens every turn
    assert kept[1]["input_ids"].tolist() == full[-limit:]


def test_a_left_truncated_prompt_keeps_the_bos_that_begins_it():
    """Llama-3's template writes <|begin_of_text|> once, first; Llama-2's tokenizer prepends <s>."""
    from tiny_models import CHAT_TEMPLATE

    tokenizer = make_tokenizer(chat_template=False, with_pad=True)
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.chat_template = "<|endoftext|>" + CHAT_TEMPLATE
    formatter = PromptFormatter(tokenizer)
    long = Sample(TURNS + ({"role": "assistant", "content": "fox " * 30}, {"role": "user", "content": "End now"}))
    full = _ids(tokenizer, formatter.prompt(long.turns))
    assert full.count(tokenizer.bos_token_id) == 1 and full[0] == tokenizer.bos_token_id
    kept = tokenize_samples([long], KIND_PROMPTS, formatter, tokenizer, TokenLimits(64, 10, "left_truncate"))
    assert kept[0]["input_ids"].tolist() == full[:1] + full[-9:]


def test_a_left_truncated_prompt_keeps_only_its_latest_tokens_when_it_has_no_bos(plain_tok):
    formatter = PromptFormatter(plain_tok, "human_assistant")
    long = Sample(TURNS + ({"role": "assistant", "content": "fox " * 30}, {"role": "user", "content": "End now"}))
    full = _ids(plain_tok, formatter.prompt(long.turns))
    assert plain_tok.bos_token_id not in full
    kept = tokenize_samples([long], KIND_PROMPTS, formatter, plain_tok, TokenLimits(64, 10, "left_truncate"))
    assert kept[0]["input_ids"].tolist() == full[-10:]


def test_prompt_collator_left_pads(chat_tok):
    pad = chat_tok.pad_token_id
    batch = PromptCollator(pad)([
        {"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.ones(3, dtype=torch.long)},
        {"input_ids": torch.tensor([8]), "attention_mask": torch.ones(1, dtype=torch.long)},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [pad, pad, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_sft_and_pairwise_collators_right_pad(chat_tok):
    pad = chat_tok.pad_token_id
    sft = SFTCollator(pad, pad_to_multiple_of=4)([
        {"input_ids": torch.tensor([1, 2, 3]), "attention_mask": torch.ones(3, dtype=torch.long), "labels": torch.tensor([-100, 2, 3])},
        {"input_ids": torch.tensor([4]), "attention_mask": torch.ones(1, dtype=torch.long), "labels": torch.tensor([4])},
    ])
    assert sft["input_ids"].tolist() == [[1, 2, 3, pad], [4, pad, pad, pad]]
    assert sft["labels"].tolist() == [[-100, 2, 3, -100], [4, -100, -100, -100]]
    assert sft["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    ones = lambda n: torch.ones(n, dtype=torch.long)
    pairs = PairwiseCollator(pad)([
        {"chosen_input_ids": torch.tensor([1, 2]), "chosen_attention_mask": ones(2),
         "rejected_input_ids": torch.tensor([1, 3]), "rejected_attention_mask": ones(2), "prompt_length": ones(1)},
        {"chosen_input_ids": torch.tensor([4, 5, 8]), "chosen_attention_mask": ones(3),
         "rejected_input_ids": torch.tensor([4, 5, 6, 7]), "rejected_attention_mask": ones(4),
         "prompt_length": torch.tensor([2])},
    ])
    assert pairs["input_ids"].tolist() == [[1, 2, pad, pad], [4, 5, 8, pad], [1, 3, pad, pad], [4, 5, 6, 7]]
    assert pairs["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert pairs["prompt_lengths"].tolist() == [1, 2]


def word_boundary_tokenizer():
    """A small tokenizer with Llama-2's rules: it prepends a word boundary '▁' to every text it is given, and
    turns spaces into '▁' (trained here on two sentences)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Human: What is the capital of France? Assistant: The capital of France is Paris. No."] * 20
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    model.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, show_progress=False,
                                                          special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def test_a_reply_is_tokenised_as_it_reads_after_its_prompt_under_a_word_boundary_tokenizer():
    """Tokenised alone, ' The capital...' became '▁' '▁The' ...: every reply began with a token the model never
    reads there. Prompt and reply are tokenised as one text, split where the prompt's own tokens end."""
    tok = word_boundary_tokenizer()
    formatter = PromptFormatter(tok, "human_assistant")
    sample = Sample(({"role": "user", "content": "What is the capital of France?"},),
                    "The capital of France is Paris.", "No.")
    row = formatter.row(sample)
    prompt = tok(row["prompt"])["input_ids"]
    assert tok.convert_ids_to_tokens(tok(row["chosen"], add_special_tokens=False)["input_ids"])[0] == "▁"
    (sft,) = tokenize_samples([sample], KIND_SFT, formatter, tok, TokenLimits(256))
    assert sft["input_ids"].tolist() == tok(row["prompt"] + row["chosen"])["input_ids"] + [tok.eos_token_id]
    answer = [token for token, label in zip(sft["input_ids"].tolist(), sft["labels"].tolist()) if label != IGNORE_INDEX]
    assert len(sft["input_ids"]) - len(answer) == len(prompt) and tok.convert_ids_to_tokens(answer)[0] == "▁The"
    (pair,) = tokenize_samples([sample], KIND_PAIRS, formatter, tok, TokenLimits(256))
    assert pair["chosen_input_ids"].tolist() == sft["input_ids"].tolist()
    assert pair["rejected_input_ids"].tolist() == tok(row["prompt"] + row["rejected"])["input_ids"] + [tok.eos_token_id]
    assert pair["prompt_length"].tolist() == [len(prompt)]
    from step2_reward.rw_eval import RewardScorer

    scorer = RewardScorer(torch.nn.Identity(), tok, prompt_format="human_assistant", max_seq_len=256)
    assert scorer.encode(row["prompt"], row["chosen"]).tolist() == pair["chosen_input_ids"].tolist()  # as trained


def test_a_tokenizer_that_appends_eos_is_loaded_without_it_so_answers_end_in_one_eos(tmp_path):
    """Llama's `add_eos_token`: every encoded text ends in EOS. Loaded through `load_tokenizer`, the prompt (step 3's
    rollout input) does not end in EOS and an SFT item ends in exactly one, which carries the loss."""
    from training.core.model_loading import load_tokenizer

    appending = make_tokenizer(chat_template=False, with_pad=True)
    appending.add_eos_token = True
    assert appending("hi")["input_ids"][-1] == appending.eos_token_id
    appending.save_pretrained(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer"))
    eos = tokenizer.eos_token_id
    formatter = PromptFormatter(tokenizer, "human_assistant")
    sample = Sample(({"role": "user", "content": "hello world"},), "good", "bad")
    (prompt,) = tokenize_samples([sample], KIND_PROMPTS, formatter, tokenizer, TokenLimits(64))
    assert prompt["input_ids"][-1] != eos
    (item,) = tokenize_samples([sample], KIND_SFT, formatter, tokenizer, TokenLimits(64))
    assert item["input_ids"].tolist().count(eos) == 1 and item["input_ids"][-1] == eos
    assert (item["labels"] != IGNORE_INDEX).sum() == len(tokenizer(" good", add_special_tokens=False)["input_ids"]) + 1


def test_a_tokenizer_that_appends_eos_without_a_switch_is_refused(tmp_path):
    from tokenizers import processors

    from training.core.model_loading import load_tokenizer

    appending = make_tokenizer(chat_template=False, with_pad=True)
    bos, eos = appending.bos_token, appending.eos_token
    appending._tokenizer.post_processor = processors.TemplateProcessing(  # BOS too: the switch would lose it
        single=f"{bos} $A {eos}", special_tokens=[(bos, appending.bos_token_id), (eos, appending.eos_token_id)])
    appending.save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(UserError, match="appends its EOS token to every text"):
        load_tokenizer(str(tmp_path / "tokenizer"))
