"""The shared DeepSpeed core: loading, ZeRO training, LoRA, saving, distributed start-up."""
import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT
from tiny_models import ARCHITECTURES, make_custom_code_model_dir, make_tokenizer
from transformers import AutoModelForCausalLM

from training.core.engine import OptimizationSettings, create_train_engine
from training.core.lora import apply_lora, lora_target_modules
from training.core.model_loading import (
    EMBEDDED_MODEL_NAME,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve_dtype,
)
from training.core.optim import LearningRateGroups
from training.core.reward_model import RewardModel
from training.core.save import save_hf_model
from training.core.zero import full_numel, full_shape, is_zero3_module, is_zero3_param
from utils.dist import free_port
from utils.errors import UserError

TEXT = ["Human: What is the capital of France? Assistant: The capital of France is Paris."] * 4


def _batch(tokenizer):
    enc = tokenizer(TEXT, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _train(engine, tokenizer, steps=8):
    ids, mask = _batch(tokenizer)
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _settings(stage, **kw):
    return OptimizationSettings(learning_rate=1e-2, num_training_steps=8, zero_stage=stage, micro_batch_size=4,
                                lr_scheduler_type="constant_with_warmup", **kw)


def test_tokenizer_gets_pad_distinct_from_eos(tiny_model_dir):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    enc = tokenizer(["hello world" + tokenizer.eos_token, "hi"], padding=True)
    assert tokenizer.eos_token_id in [t for t, m in zip(enc["input_ids"][0], enc["attention_mask"][0]) if m]


def test_tokenizer_without_unk_adds_pad_and_model_resizes(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.unk_token = None
    model_dir = tmp_path / "m"
    from tiny_models import make_tiny_model

    model, _ = make_tiny_model("llama", tokenizer)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    loaded_tok = load_tokenizer(str(model_dir))
    assert loaded_tok.pad_token == "<|pad|>" and len(loaded_tok) == len(tokenizer) + 1
    model = load_causal_lm(str(model_dir), loaded_tok)
    assert model.get_input_embeddings().weight.shape[0] >= len(loaded_tok)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="not found locally"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="hub"):
        load_causal_lm("no-such-org/no-such-model")


@pytest.fixture
def unreachable_hub(monkeypatch) -> list[float]:
    """The hub at a closed local port (HF_HUB_OFFLINE unset, no network used): each lookup of a file no cache holds
    fails, after huggingface_hub's retries; the seconds it waits between them, recorded instead of slept, returned."""
    import huggingface_hub.constants
    import huggingface_hub.utils._http as hub_http

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    waits = []
    monkeypatch.setattr(hub_http, "time", SimpleNamespace(sleep=waits.append))
    return waits


def test_an_unreachable_hub_is_waited_for_once_per_model_name(unreachable_hub):
    """With the hub unreachable but HF_HUB_OFFLINE unset, a lookup waits out huggingface_hub's retries (about 23 s)
    before it fails, and each loader made two (a model its adapter_config.json, then its config.json; a tokenizer its
    config.json twice): a model name the hub could not be asked about was said after 46 s. Now one lookup's wait, once
    a name: its next loads fail at once, with the same message."""
    from huggingface_hub import hf_hub_download

    with pytest.raises(OSError):
        hf_hub_download("no-such-org/other-model", "config.json")
    one_lookup = sum(unreachable_hub)
    assert one_lookup > 0
    unreachable_hub.clear()
    name = f"no-such-org/model-{uuid.uuid4().hex}"  # a name this process never looked up
    for load in (load_tokenizer, load_causal_lm, load_config):
        with pytest.raises(UserError, match=f"'{name}' was not found locally and could not be fetched from the hub: "
                                            "the hub cannot be reached from here"):
            load(name)
        assert sum(unreachable_hub) == one_lookup


def test_a_hub_model_transformers_cannot_load_is_one_error(hub_cache):
    """A hub model whose type this transformers does not know (one newer than it) raised transformers' ValueError as a
    traceback; a local folder's was one error already."""
    hub_cache.put("some-org/brand-new", {"model_type": "brand_new_arch"})
    for load in (load_config, load_causal_lm):
        with pytest.raises(UserError, match="the model of 'some-org/brand-new' does not load with transformers .*: "
                                            "The checkpoint you are trying to load has model type `brand_new_arch` "
                                            ".* -- a model newer than this transformers loads after 'pip install "
                                            "--upgrade transformers'; otherwise"):
            load("some-org/brand-new")


def test_a_hub_model_with_its_own_code_says_trust_remote_code(hub_cache):
    """A hub model that ships its own code (auto_map) was told to upgrade transformers or pick another model; what
    loads it is --trust_remote_code."""
    hub_cache.put("some-org/custom", {"model_type": "custom_x", "auto_map": {
        "AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}})
    for load in (load_config, load_causal_lm):
        with pytest.raises(UserError) as raised:
            load("some-org/custom")
        assert str(raised.value) == ("'some-org/custom' ships its own model code (auto_map in its config.json), "
                                     "which runs only with --trust_remote_code; add that flag if you trust the code, "
                                     "or choose another model")


def test_a_local_model_with_its_own_code_says_trust_remote_code(tmp_path):
    """A local folder whose model ships its own code was refused in transformers' first line alone ("contains custom
    code which must be executed"), which names no flag of this project; with --trust_remote_code its code loads it."""
    model = make_custom_code_model_dir(tmp_path / "custom")
    for load in (load_config, load_causal_lm):
        with pytest.raises(UserError, match=r"^'.*custom' ships its own model code \(auto_map in its config.json\), "
                                            "which runs only with --trust_remote_code"):
            load(model)
    assert type(load_causal_lm(model, trust_remote_code=True)).__name__ == "CustomForCausalLM"


def test_a_model_whose_tokenizer_alone_ships_its_own_code_says_trust_remote_code(tmp_path, tiny_model_dir):
    """A model of a type transformers knows whose tokenizer ships its own code (an auto_map in tokenizer_config.json
    alone) was refused in transformers' words ("pass the argument `trust_remote_code=True`"), which name no flag of
    this project; the model itself loads without the flag, and with it the tokenizer's code loads the tokenizer."""
    model = make_custom_code_model_dir(tmp_path / "custom")
    shutil.copy(os.path.join(tiny_model_dir("llama"), "config.json"), os.path.join(model, "config.json"))
    with pytest.raises(UserError, match=r"^'.*custom' ships its own tokenizer code \(auto_map in its "
                                        r"tokenizer_config.json\), which runs only with --trust_remote_code; add"):
        load_tokenizer(model)
    assert load_config(model).model_type == "llama"
    assert type(load_tokenizer(model, trust_remote_code=True)).__name__ == "CustomTokenizerFast"


def test_other_hub_model_errors_are_said_without_upgrade_advice(hub_cache):
    """A hub model transformers knows but cannot load as asked (an image model: no causal LM), or a config without a
    model type, was told to upgrade transformers; each is said in transformers' words alone."""
    hub_cache.put("some-org/vision", {"model_type": "vit"})
    hub_cache.put("some-org/untyped", {})
    for name, load, words in (("some-org/vision", load_causal_lm, "Unrecognized configuration class"),
                              ("some-org/untyped", load_config, "Should have a `model_type` key")):
        with pytest.raises(UserError) as raised:
            load(name)
        message = str(raised.value)
        assert message.startswith(f"the model of '{name}' does not load with transformers ")
        assert words in message and "upgrade" not in message


def test_a_hub_lookup_is_not_remembered_past_a_download_or_a_move(hub_cache, tmp_path, monkeypatch):
    """A hub name's failed lookup was remembered for the process by its text alone: the model downloaded since, or
    the name a folder from the working directory moved to, still said 'the hub cannot be reached'."""
    name = "some-org/later"
    with pytest.raises(UserError, match="the hub cannot be reached from here"):
        load_config(name)
    hub_cache.put(name, {"model_type": "gpt2"})
    assert load_config(name).model_type == "gpt2"
    other = "some-org/elsewhere"
    with pytest.raises(UserError, match="the hub cannot be reached from here"):
        load_config(other)
    project = tmp_path / "project"
    (project / other).mkdir(parents=True)
    (project / other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    monkeypatch.chdir(project)
    assert load_config(other).model_type == "gpt2"


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_hub_tokenizer_no_cache_holds_says_so_offline(hub_cache, tiny_model_dir, model_type):
    """Offline, a hub model whose config.json the cache holds but not its tokenizer's files was looked up by its
    config.json alone, found, and transformers built the tokenizer from the model type: for llama an error asking to
    install sentencepiece, for gpt2 a tokenizer of no vocabulary, loaded. It is said as an uncached model is; with
    its tokenizer's files cached it loads."""
    model = Path(tiny_model_dir(model_type))
    config = json.loads((model / "config.json").read_text())
    hub_cache.put("some-org/untokenized", config)
    with pytest.raises(UserError) as raised:
        load_tokenizer("some-org/untokenized")
    assert str(raised.value) == ("tokenizer 'some-org/untokenized' was not found locally and could not be fetched "
                                 "from the hub: the hub cannot be reached from here; download the model elsewhere and "
                                 f"pass its local folder (or use the embedded default '{EMBEDDED_MODEL_NAME}')")
    assert load_config("some-org/untokenized").model_type == model_type
    hub_cache.put("some-org/tokenized", config, {name: (model / name).read_text()
                                                 for name in ("tokenizer.json", "tokenizer_config.json")})
    assert load_tokenizer("some-org/tokenized").get_vocab() == load_tokenizer(str(model)).get_vocab()


def _bpe_vocabulary_files(tokenizer_json: str) -> dict[str, str]:
    """The vocab.json and merges.txt of a byte-level BPE tokenizer.json, as an older GPT-2 repo holds them alone."""
    bpe = json.loads(tokenizer_json)["model"]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in bpe["merges"]]
    return {"vocab.json": json.dumps(bpe["vocab"]),
            "merges.txt": "".join(f"{merge}\n" for merge in ["#version: 0.2", *merges])}


def _sentencepiece_model() -> bytes:
    """A tiny sentencepiece tokenizer.model, as an older Llama repo holds it alone."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["the quick brown fox jumps over a lazy dog"] * 20),
                                             model_writer=model, vocab_size=40, model_type="bpe", minloglevel=2)
    return model.getvalue()


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_a_hub_tokenizer_cached_as_an_older_repo_holds_it_loads_offline(hub_cache, tiny_model_dir, model_type):
    """Offline, a hub model whose cache holds config.json and only vocab.json/merges.txt (GPT-2) or tokenizer.model
    (Llama), older repos without tokenizer_config.json or tokenizer.json, was refused as not found locally, as if no
    tokenizer file were cached; it loads from them, as before 6c262ad."""
    model = Path(tiny_model_dir(model_type, vocab_size=300))  # some merges beyond the byte alphabet
    if model_type == "gpt2":
        files = _bpe_vocabulary_files((model / "tokenizer.json").read_text())
    else:
        files = {"tokenizer.model": _sentencepiece_model()}
    hub_cache.put("some-org/older", json.loads((model / "config.json").read_text()), files)
    vocabulary = load_tokenizer("some-org/older").get_vocab()
    cached = json.loads(files["vocab.json"]) if model_type == "gpt2" else {}
    assert len(vocabulary) >= 40 and cached.items() <= vocabulary.items()


def test_dtype_rules_on_cpu():
    assert resolve_dtype("fp32") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(UserError, match="fp16"):
        resolve_dtype("fp16")


@pytest.mark.parametrize("native", [False, True])
def test_dtype_auto_on_cpu_is_bf16_only_with_bf16_instructions(monkeypatch, native):
    """DeepSpeed's CPU accelerator calls bf16 supported everywhere, but without bf16 instructions torch emulates
    it (over 10x slower than fp32 on AVX2): auto, and train.py's plan, take fp32 there."""
    from training.pipeline.hardware import detect_hardware

    monkeypatch.setattr("training.core.model_loading.cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr("training.pipeline.hardware.cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert detect_hardware().bf16 is native


@pytest.mark.parametrize("field, value, native", [
    ("flags", "fpu sse avx2 avx512f avx512bw avx512vl avx512dq", False),  # oneDNN would emulate bf16 here
    ("flags", "avx2 avx512f avx512_bf16", True),
    ("flags", "avx2 amx_tile amx_bf16", True),
    ("Features", "fp asimd sve bf16 i8mm", True),  # Arm (Graviton 3) names it among its Features
    ("Features", "fp asimd", False),
])
def test_native_bf16_is_read_from_the_cpus_flags(monkeypatch, field, value, native):
    from utils import cpu

    monkeypatch.setattr(cpu, "_cpuinfo_field", lambda name: value if name == field else "")
    assert cpu.cpu_has_native_bf16() is native


def test_zero3_helpers_report_full_sizes_of_partitioned_parameters(distributed):
    import deepspeed

    from training.core.ds_config import get_eval_ds_config

    plain = torch.nn.Linear(4, 3)
    with deepspeed.zero.Init(config_dict_or_path=get_eval_ds_config(stage=3)):
        partitioned = torch.nn.Linear(4, 3)
    assert partitioned.weight.numel() == 0, "ZeRO-3 should have emptied the parameter"
    assert is_zero3_param(partitioned.weight) and is_zero3_module(partitioned)
    assert not is_zero3_param(plain.weight) and not is_zero3_module(plain)
    for module in (plain, partitioned):
        assert (full_numel(module.weight), full_shape(module.weight)) == (12, (3, 4))
        assert (full_numel(module.bias), full_shape(module.bias)) == (3, (3,))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_few_steps_lower_the_loss(distributed, tiny_model_dir, arch, stage):
    path = tiny_model_dir(arch)
    tokenizer = load_tokenizer(path)
    settings = _settings(stage)
    model = load_causal_lm(path, tokenizer, ds_config=settings.ds_config(), disable_dropout_layers=True)
    engine = create_train_engine(model, settings)
    losses = _train(engine, tokenizer)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero3_grows_the_embeddings_for_an_added_pad_token(distributed, tmp_path, arch):
    """A tokenizer whose unk is missing or is the EOS (GPT-2, Llama-3) gets a pad token added; at ZeRO-3 growing the
    embeddings after the ZeRO-3 context crashed (transformers took the partitioned embedding for an empty whole)."""
    from tiny_models import make_tiny_model

    tokenizer = make_tokenizer()
    tokenizer.unk_token = None
    model, _ = make_tiny_model(arch, tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) > model.config.vocab_size, "the pad token is a new one"
    settings = _settings(3)
    for loaded in (load_causal_lm(path, tokenizer, ds_config=settings.ds_config()),
                   RewardModel.from_causal_lm(path, tokenizer, ds_config=settings.ds_config())):
        assert full_shape(loaded.get_input_embeddings().weight)[0] >= len(tokenizer)
    losses = _train(create_train_engine(load_causal_lm(path, tokenizer, ds_config=settings.ds_config()), settings),
                    tokenizer, steps=2)
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_single_rank_zero0_skips_the_gradient_allreduce_and_trains_bit_identically(distributed, tiny_model_dir,
                                                                                   dtype):
    """Over one rank DeepSpeed's ZeRO-0 all-reduce copies every gradient and changes nothing: it is skipped, and
    the weights after training equal, bit for bit, those of an engine that runs it."""
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    settings = _settings(0, dtype=dtype)

    def trained(allreduce: bool) -> tuple[list, dict[str, torch.Tensor]]:
        model = load_causal_lm(path, tokenizer, dtype=resolve_dtype(dtype), ds_config=settings.ds_config(),
                               disable_dropout_layers=True)
        engine = create_train_engine(model, settings)
        calls, reduce = [], engine.allreduce_gradients
        engine.allreduce_gradients = lambda *args, **kwargs: (calls.append(1), reduce(*args, **kwargs))
        engine.enable_backward_allreduce = engine.enable_backward_allreduce or allreduce
        _train(engine, tokenizer, steps=3)
        return calls, {name: p.detach().clone() for name, p in engine.module.named_parameters()}

    skipped_calls, skipped = trained(allreduce=False)
    reduced_calls, reduced = trained(allreduce=True)
    assert (len(skipped_calls), len(reduced_calls)) == (0, 3)
    assert any(not torch.equal(skipped[name], p) for name, p in load_causal_lm(
        path, tokenizer, dtype=resolve_dtype(dtype)).named_parameters()), "training changed no weight"
    for name, weight in skipped.items():
        assert torch.equal(weight, reduced[name]), name


@pytest.mark.parametrize("stage", [0, 3])
def test_save_then_load_gives_identical_logits(distributed, tiny_model_dir, tmp_path, stage):
    path = tiny_model_dir("gpt2")
    tokenizer = load_tokenizer(path)
    settings = _settings(stage)
    engine = create_train_engine(load_causal_lm(path, tokenizer, ds_config=settings.ds_config()), settings)
    _train(engine, tokenizer, steps=2)
    engine.eval()
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        expected = engine(input_ids=ids, attention_mask=mask).logits
    out = tmp_path / "saved"
    save_hf_model(engine, tokenizer, out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        actual = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,module_name", [("llama", "layers."), ("gpt2", "h."), ("opt", "decoder.layers.")])
def test_lora_saved_merged_matches_unmerged(distributed, tiny_model_dir, tmp_path, arch, module_name):
    path = tiny_model_dir(arch)
    tokenizer = load_tokenizer(path)
    model = apply_lora(load_causal_lm(path, tokenizer), lora_dim=4, lora_module_name=module_name,
                       only_optimize_lora=True)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    settings = _settings(2, lora_learning_rate=5e-2)
    engine = create_train_engine(model, settings)
    _train(engine, tokenizer, steps=3)
    engine.eval()
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        expected = engine(input_ids=ids, attention_mask=mask).logits
        base = model.get_base_model()
        with model.disable_adapter():
            without_adapters = engine(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(expected, without_adapters, atol=1e-4), "LoRA training changed nothing"
    out = tmp_path / "merged"
    save_hf_model(engine, tokenizer, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        actual = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
    assert base is model.get_base_model()


@pytest.mark.parametrize("stage", [0, 3])
def test_the_logged_learning_rates_name_the_lora_adapters_own_rate(distributed, tiny_model_dir, stage):
    """--lora_learning_rate trains the adapters at a rate of their own; the log showed the first parameter group's
    rate alone (the other weights'), so the adapters' never appeared."""
    from step3_rlhf.run_loop import PPORun

    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    plain = create_train_engine(load_causal_lm(path, tokenizer), _settings(stage))
    with_lora = create_train_engine(apply_lora(load_causal_lm(path, tokenizer), lora_dim=4, lora_module_name="layers."),
                                    _settings(stage, lora_learning_rate=5e-2))
    only_lora = create_train_engine(apply_lora(load_causal_lm(path, tokenizer), lora_dim=4, lora_module_name="layers.",
                                               only_optimize_lora=True), _settings(stage, lora_learning_rate=5e-2))
    assert logged_learning_rates(plain) == {"train/lr": 1e-2}
    assert logged_learning_rates(with_lora) == {"train/lr": 1e-2, "train/lora_lr": 5e-2}
    assert logged_learning_rates(only_lora) == {"train/lr": 5e-2, "train/lora_lr": 5e-2}
    step3 = SimpleNamespace(engines={"actor": with_lora},
                            learning_rate_groups={"actor": LearningRateGroups.of(with_lora)})
    assert PPORun.learning_rates(step3) == {"train/actor_lr": 1e-2, "train/actor_lora_lr": 5e-2}
    # read at every logging step without walking the model's parameters again: from an engine with no model
    groups = LearningRateGroups.of(with_lora)
    assert groups.logged(SimpleNamespace(get_lr=with_lora.get_lr), "train/") == logged_learning_rates(with_lora)
    # groups that are not the model's are refused at start-up, as the groups are found
    with pytest.raises(ValueError, match="3 learning rates for 2 parameter groups"):
        LearningRateGroups.of(SimpleNamespace(module=plain.module, get_lr=lambda: [*plain.get_lr(), 1.0]))


def logged_learning_rates(engine) -> dict[str, float]:
    return LearningRateGroups.of(engine).logged(engine, "train/")


def test_lora_module_name_that_matches_nothing(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir("llama"))
    assert "model.layers.0.self_attn.q_proj" in lora_target_modules(model, "layers.")
    with pytest.raises(UserError, match="matches no linear layer"):
        apply_lora(model, 4, "no_such_block.")


@pytest.mark.parametrize("stage", [0, 3])
def test_two_process_zero_over_gloo_trains_and_saves(tiny_model_dir, tmp_path, stage):
    """Each rank trains on its own half of a batch; at ZeRO-0 their full weight copies must stay equal (the
    gradient all-reduce, skipped only over a single rank, still runs over two)."""
    path = tiny_model_dir("llama")
    out = tmp_path / "zero-out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(REPO_ROOT / "tests" / "scripts" / "zero_worker.py"), path, str(out),
           str(stage)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "LOSS_FELL" in result.stdout
    assert stage != 0 or "RANKS_AGREE" in result.stdout, result.stdout[-3000:]
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_a_step_run_folder_resolves_to_its_final_model(tiny_model_dir, tmp_path):
    from training.core.model_loading import FINAL_MODEL_SUBDIR, resolve_model_path

    run_dir = tmp_path / "run"
    model_dir = tiny_model_dir("opt")
    (run_dir).mkdir()
    os.replace(model_dir, run_dir / FINAL_MODEL_SUBDIR)
    assert resolve_model_path(str(run_dir)) == str(run_dir / FINAL_MODEL_SUBDIR)
    assert load_tokenizer(str(run_dir)).pad_token_id is not None


def test_a_model_folder_under_the_home_tilde_loads(tiny_model_dir, monkeypatch):
    """'~/model' unexpanded by a shell (quoted, `--flag=~/model`, train.py's --step1-args) passed the steps' model
    check (`check_model_source` expands it) and every loader then said the folder held no model: transformers took
    it for a hub name."""
    from pathlib import Path

    from training.core.model_loading import FINAL_MODEL_SUBDIR, resolve_trained_model
    from training.reliability.validation import check_model_source

    model = Path(tiny_model_dir("llama"))
    monkeypatch.setenv("HOME", str(model.parent))
    path = f"~/{model.name}"
    check_model_source(path)
    tokenizer = load_tokenizer(path)
    assert isinstance(load_causal_lm(path, tokenizer), torch.nn.Module)
    assert isinstance(RewardModel.from_causal_lm(path, tokenizer), RewardModel)
    step1 = model.parent / "runs" / "step1"  # a train.py output folder stopped after step 1
    step1.mkdir(parents=True)
    os.replace(model, step1 / FINAL_MODEL_SUBDIR)
    assert resolve_trained_model("~/runs") == str(step1 / FINAL_MODEL_SUBDIR)


def test_loading_keeps_the_generation_configs_other_stop_ids_after_the_tokenizers_eos(tiny_model_dir):
    """Loading set the generation config's eos_token_id to the tokenizer's EOS alone: a Gemma model, whose list
    [<eos>, <end_of_turn>] it replaced, was saved to be served without its end-of-turn stop, and training now ends
    its answers at that token."""
    import json
    from pathlib import Path

    model_dir = tiny_model_dir("llama")
    tokenizer = load_tokenizer(model_dir)
    eos, end_of_turn = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config_file = Path(model_dir) / "generation_config.json"
    for listed, expected in (([end_of_turn, eos], [eos, end_of_turn]), (eos, eos), (None, eos)):
        config_file.write_text(json.dumps({"eos_token_id": listed}))
        assert load_causal_lm(model_dir, tokenizer).generation_config.eos_token_id == expected, listed


def test_a_train_py_folder_stopped_before_step3_resolves_to_its_step1_model(tiny_model_dir, tmp_path, caplog):
    """`chatbot.py --path runs/default` after `train.py --step 1` said the folder held no model."""
    from training.core.model_loading import FINAL_MODEL_SUBDIR, resolve_trained_model

    pipeline = tmp_path / "runs"
    (pipeline / "step1").mkdir(parents=True)
    os.replace(tiny_model_dir("opt"), pipeline / "step1" / FINAL_MODEL_SUBDIR)
    assert resolve_trained_model(str(pipeline)) == str(pipeline / "step1" / FINAL_MODEL_SUBDIR)
    assert "no step-3 actor nor DPO model yet: using its step-1 model" in caplog.text


def test_a_file_passed_as_a_model_is_one_error_in_every_tool(tiny_model_dir):
    """The steps, prompt_eval and rw_eval went on to transformers, which read a run's args.json or a model's
    config.json as a config and failed obscurely; the steps' own check (`check_model_source`) refused it in other
    words than the tools."""
    from training.core.model_loading import resolve_model_path
    from training.reliability.validation import check_model_source

    model = tiny_model_dir("opt")
    refusal = rf"{model}/config.json is a file; pass the folder that holds the model \({model}\) or a run folder"
    with pytest.raises(UserError, match=refusal):
        resolve_model_path(f"{model}/config.json")
    with pytest.raises(UserError, match=f"--actor_model_name_or_path {refusal}"):
        check_model_source(f"{model}/config.json", "--actor_model_name_or_path")
    with pytest.raises(UserError, match="is a file"):
        load_tokenizer(f"{model}/config.json")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_disabled_dropout_makes_train_mode_forwards_deterministic(tiny_model_dir, arch):
    """OPT's layers copy `config.dropout` into a float at construction and call `F.dropout` with it: zeroing the
    config afterwards left step 3's OPT actor and critic (and --disable_dropout in steps 1 and 2) with dropout on,
    so the first PPO update on a fresh rollout already had ratio != 1 (train-mode forwards differed by 0.17)."""
    path = tiny_model_dir(arch)
    tokenizer = load_tokenizer(path)
    ids = torch.tensor([tokenizer("Human: What is 2 plus 3? Assistant: 5")["input_ids"]])
    for model, output in ((load_causal_lm(path, tokenizer, disable_dropout_layers=True), "logits"),
                          (RewardModel.from_causal_lm(path, tokenizer, disable_dropout_layers=True), "values")):
        model.train()
        first, second = (model(input_ids=ids, attention_mask=torch.ones_like(ids))[output] for _ in range(2))
        assert torch.equal(first, second), f"{arch} {type(model).__name__}: dropout still on in train mode"


@pytest.mark.parametrize("kind", ["causal_lm", "lora", "reward_model"])
def test_a_model_trained_with_gradient_checkpointing_is_saved_with_its_kv_cache_on(tiny_model_dir, tmp_path, kind):
    """Gradient checkpointing sets `use_cache` off for training, and the saved config.json kept it: loaded without its
    generation_config.json, the model generated without a KV cache (each token recomputed the whole sequence), and a
    plain forward returned no cache. The live model keeps it off."""
    import json

    from training.core.args import ModelTrainingConfig, apply_model_options

    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, tokenizer)
    if kind == "reward_model":
        model = RewardModel.from_causal_lm(model, tokenizer)
    options = ModelTrainingConfig(gradient_checkpointing=True, lora_dim=4 if kind == "lora" else 0)
    model = apply_model_options(model, options)
    save_hf_model(model, tokenizer, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False


@pytest.mark.parametrize("kind", ["causal_lm", "lora", "reward_model"])
def test_a_model_trained_without_dropout_is_saved_with_its_own_dropout(tiny_model_dir, tmp_path, kind):
    """`disable_dropout` zeroes the config's dropout probabilities too, and the saved config.json kept the zeros: step
    3's actor, its EMA and critic, and DPO's model (always trained without dropout) said 0.0, so a run trained further
    from them silently had no dropout. The live model keeps dropout off."""
    from training.core.args import ModelTrainingConfig, apply_model_options

    source_dropout = {"dropout": 0.1, "attention_dropout": 0.1, "layerdrop": 0.05}
    path = tiny_model_dir("opt", config_overrides=source_dropout)
    tokenizer = load_tokenizer(path)
    if kind == "reward_model":
        model = RewardModel.from_causal_lm(load_causal_lm(path, tokenizer, disable_dropout_layers=True), tokenizer)
    else:
        model = load_causal_lm(path, tokenizer, disable_dropout_layers=True)
    model = apply_model_options(model, ModelTrainingConfig(lora_dim=4 if kind == "lora" else 0))
    save_hf_model(model, tokenizer, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert {key: saved[key] for key in source_dropout} == source_dropout
    assert {key: getattr(model.config, key) for key in source_dropout} == dict.fromkeys(source_dropout, 0.0)
    ids = torch.tensor([tokenizer("Human: What is 2 plus 3? Assistant: 5")["input_ids"]])
    output = "values" if kind == "reward_model" else "logits"
    model.train()
    first, second = (model(input_ids=ids, attention_mask=torch.ones_like(ids))[output] for _ in range(2))
    assert torch.equal(first, second), "dropout back on in the live model after the save"
