"""Load any Hugging Face causal LM and its tokenizer, by hub name, local path or the embedded default."""
from __future__ import annotations

import functools
import logging
import os
import pickle
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeVar

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

from training.core.embedded_model import (
    EMBEDDED_MODEL_NAME,
    embedded_model_path,
    is_embedded_name,
)
from utils.cpu import cpu_has_native_bf16
from utils.errors import UserError

logger = logging.getLogger(__name__)
T = TypeVar("T")
# transformers' words for a model type it does not know
_UNKNOWN_MODEL_TYPE = "does not recognize this architecture"
_OWN_CODE_FILES = {"model": "config.json", "tokenizer": "tokenizer_config.json"}  # where a part says it ships code

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "FINAL_MODEL_SUBDIR",
    "refuse_file",
    "resolve_model_path",
    "resolve_dtype",
    "resolve_trained_dtype",
    "on_inference_device",
    "TRAINED_DTYPE_HELP",
    "resolve_trained_model",
    "asks_for_own_code",
    "own_code_part",
    "own_code_error",
    "load_tokenizer",
    "load_config",
    "load_causal_lm",
    "match_tokenizer",
    "listed_stop_ids",
    "folder_stop_ids",
    "answer_stop_ids",
    "no_model_error",
    "disable_dropout",
    "configs_dropout_as_loaded",
    "zero3_construction",
]

_PAD_TOKEN = "<|pad|>"
_ADAPTER_CONFIG = "adapter_config.json"  # a PEFT (LoRA) adapter saved alone, without its base model
# a tokenizer loads from any of these (older repos: sentencepiece's tokenizer.model, or BPE's vocab.json and merges.txt)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAVED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.json's


FINAL_MODEL_SUBDIR = "model"


def refuse_file(name_or_path: str, flag: str | None = None) -> None:
    """A `UserError` where a model is wanted and `name_or_path` is a file (a model's config.json, its weights, a run's
    args.json): transformers took it for a model's config and failed obscurely."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        given = f"{flag} {name_or_path}" if flag else name_or_path
        raise UserError(f"{given} is a file; pass the folder that holds the model ({path.parent}) or a run folder")


def resolve_model_path(name_or_path: str) -> str:
    """Map the embedded default's short name to its local folder, and a step's run folder to the
    final model inside it (`<output_dir>/model`); return anything else as it is, a leading `~` expanded (transformers
    takes '~/model' for a hub name). A file is refused (`refuse_file`)."""
    if is_embedded_name(name_or_path):
        return embedded_model_path()
    refuse_file(name_or_path)
    run_dir = Path(name_or_path).expanduser()
    if not (run_dir / "config.json").is_file() and (run_dir / FINAL_MODEL_SUBDIR / "config.json").is_file():
        return str(run_dir / FINAL_MODEL_SUBDIR)
    return os.path.expanduser(name_or_path)


def resolve_trained_model(path: str, ema: bool = False) -> str:
    """The causal LM a run folder holds: a train.py output dir its step-3 actor (else its DPO model, else, with a
    warning, its step-1 model: a run stopped before step 3), a step-3 run folder its `actor/` (or `actor_ema/` with
    `ema`), a step-1 or DPO run folder its `model/`; anything else as `resolve_model_path` maps it. With `ema` and
    no EMA actor, a `UserError`."""
    actor = "actor_ema" if ema else "actor"
    folder = Path(path).expanduser()
    for candidate in (folder / "step3" / actor, folder / actor):
        if (candidate / "config.json").is_file():
            return str(candidate)
    if ema:
        raise UserError(f"{path} holds no EMA actor ({actor}/); run step 3 with --enable_ema or drop --ema")
    if (folder / "dpo" / FINAL_MODEL_SUBDIR / "config.json").is_file():
        return str(folder / "dpo" / FINAL_MODEL_SUBDIR)
    step1_model = folder / "step1" / FINAL_MODEL_SUBDIR
    if (step1_model / "config.json").is_file():
        logger.warning("%s holds no step-3 actor nor DPO model yet: using its step-1 model %s", path, step1_model)
        return str(step1_model)
    return resolve_model_path(path)


def resolve_dtype(name: str | None, flag: str = "--dtype") -> torch.dtype:
    """`bf16`/`fp16`/`fp32`, or None/"auto" for the device's best: bf16 where the GPU supports it, else fp16; on CPU
    bf16 only where the CPU has bf16 instructions (elsewhere torch emulates it, slower than fp32), else fp32. `flag`
    names the setting in errors."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    if name is None or name == "auto":
        if cpu_has_native_bf16() if on_cpu else accelerator.is_bf16_supported():
            return torch.bfloat16
        return torch.float32 if on_cpu else torch.float16
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    if name == "fp16" and on_cpu:
        raise UserError(f"{flag} fp16: fp16 is not supported on CPU; use {flag} bf16 or {flag} fp32")
    if name == "bf16" and not accelerator.is_bf16_supported():
        raise UserError(f"{flag} bf16: this device does not support bf16; use {flag} fp32 (or fp16 on a GPU)")
    return _DTYPES[name]


TRAINED_DTYPE_HELP = ("auto: for a model a run of this project saved, the dtype it trained in where this device "
                      "computes in it natively; otherwise bf16 where the device supports it, else fp16 on GPU, fp32 "
                      "on CPU")


def resolve_trained_dtype(name: str | None, model_path: str) -> torch.dtype:
    """`resolve_dtype(name)`, except that "auto" (or None) for a model a run of this project saved (an args.json
    beside it) is the dtype it was saved in, which its run trained and evaluated it in, where this device computes
    in that dtype natively (fp32; bf16 where "auto" picks it; fp16 on a GPU): in the device's best instead, an
    fp32-trained model's greedy answers and scores were not its run's."""
    from deepspeed.accelerator import get_accelerator

    from training.reliability.run_records import read_record, run_dir_of  # it builds on this module

    best = resolve_dtype(name)
    if name not in (None, "auto") or is_embedded_name(model_path):
        return best
    folder = resolve_model_path(model_path)
    config = read_record(folder, "config.json") or {}
    saved = _SAVED_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))
    if saved is None or run_dir_of(folder) is None:
        return best
    on_gpu = get_accelerator().device_name() != "cpu"
    return saved if saved in (torch.float32, best) or (saved == torch.float16 and on_gpu) else best


def on_inference_device(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode on the device a tool (the chatbot, prompt_eval, rw_eval) runs it on: the accelerator's
    (whose dtype `resolve_trained_dtype` chose), with cuDNN's attention kernel left out on a GPU
    (`exclude_cudnn_attention`). prompt_eval and rw_eval left their models on the CPU of a GPU machine."""
    from deepspeed.accelerator import get_accelerator

    from training.core.attention_kernels import exclude_cudnn_attention

    device = torch.device(get_accelerator().device_name())
    exclude_cudnn_attention(device.type)
    return model.to(device).eval()


def _hub_call(what: str, name_or_path: str, load: Callable[[], T], trust_remote_code: bool) -> T:
    """Run a from_pretrained call, turning 'not found' and 'offline' into one clear message, and a model whose own
    code it was not allowed to run into the flag that allows it; a hub name's hub is reached once first
    (`_hub_lookup_failure`)."""
    failure = _hub_lookup_failure(resolve_model_path(name_or_path), what)
    if failure is not None:
        raise _not_fetched_error(what, name_or_path, unreachable=True) from failure
    try:
        return load()
    except ValueError as err:
        shipping = None if trust_remote_code else own_code_part(name_or_path, with_tokenizer=what == "tokenizer")
        if shipping is not None:
            raise own_code_error(name_or_path, part=shipping) from err
        raise _load_error(what, name_or_path, err) from err
    except pickle.UnpicklingError as err:  # a .bin file that torch.load(weights_only=True) refuses
        raise UserError(
            f"the {what} files in {name_or_path} hold pickled objects that a safe load refuses (they could run "
            "code); use a model saved as safetensors, or convert it with a tool you trust"
        ) from err
    except OSError as err:
        raise _load_error(what, name_or_path, err) from err


def _load_error(what: str, name_or_path: str, err: OSError | ValueError) -> UserError:
    """Why the `what` of a local folder, or of a hub name, did not load."""
    if Path(name_or_path).expanduser().is_dir():
        return _local_folder_error(what, name_or_path, err)
    if isinstance(err, ValueError):
        return _not_loadable_error(what, name_or_path, err)
    return _not_fetched_error(what, name_or_path, _hub_unreachable(err))


def asks_for_own_code(name_or_path: str) -> bool:
    """Whether the model loads only by running code it ships: its config.json (in its folder, or in the hub cache for
    a hub name) maps transformers' auto classes to its own (`auto_map`) and names a model type transformers has no
    causal LM of. A type transformers knows loads with its code without the model's (Phi-3's checkpoints keep the
    auto_map of the code they shipped before transformers had it)."""
    config = _config_json(resolve_model_path(name_or_path))
    return bool(config.get("auto_map")) and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _tokenizer_asks_for_own_code(name_or_path: str) -> bool:
    """Whether the tokenizer loads only by running code it ships, whatever the model's config.json says: its
    tokenizer_config.json maps AutoTokenizer to its own class (`auto_map`) and names a tokenizer class transformers
    has not, as transformers decides it. Without a tokenizer class transformers takes the model type's tokenizer."""
    config = _config_json(resolve_model_path(name_or_path), "tokenizer_config.json")
    auto_map = config.get("auto_map")
    own = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    known = name and (tokenizer_class_from_name(name) or tokenizer_class_from_name(f"{name}Fast"))
    return bool(own) and bool(name) and not known


def own_code_part(name_or_path: str, with_tokenizer: bool = True) -> str | None:
    """The part of the model that loads only by code it ships: "model" (`asks_for_own_code`), else with
    `with_tokenizer` "tokenizer" (`_tokenizer_asks_for_own_code`); None where none does."""
    if asks_for_own_code(name_or_path):
        return "model"
    if with_tokenizer and _tokenizer_asks_for_own_code(name_or_path):
        return "tokenizer"
    return None


def own_code_error(name_or_path: str, flag: str | None = None, part: str = "model") -> UserError:
    """The error for a model whose `part` loads only by code it ships (`own_code_part`), loaded without
    --trust_remote_code; `flag` names the setting."""
    given = f"{flag} {name_or_path}" if flag else f"'{name_or_path}'"
    return UserError(f"{given} ships its own {part} code (auto_map in its {_OWN_CODE_FILES[part]}), which runs only "
                     "with --trust_remote_code; add that flag if you trust the code, or choose another model")


def _config_json(path: str, file: str = "config.json") -> dict:
    """A local folder's JSON `file` (its config.json), or a hub name's where the hub cache holds it ({} where neither
    does)."""
    from training.reliability.run_records import read_record  # it builds on this module

    folder = Path(path)
    if not folder.is_dir():
        try:
            cached = try_to_load_from_cache(path, file, cache_dir=hub_constants.HF_HUB_CACHE)
        except ValueError:  # not a valid hub name
            return {}
        if not isinstance(cached, str):
            return {}
        folder = Path(cached).parent
    return read_record(folder, file) or {}


def _not_loadable_error(what: str, name_or_path: str, err: ValueError) -> UserError:
    """Why a hub model's `what` that was fetched did not load, and what to do where that is known: it came as a
    traceback. Only a model type this transformers does not know is fixed by upgrading it; anything else is said in
    transformers' words alone."""
    reason = " ".join(str(err).split()) or type(err).__name__
    advice = ""
    if _UNKNOWN_MODEL_TYPE in reason:
        advice = (" -- a model newer than this transformers loads after 'pip install --upgrade transformers'; "
                  "otherwise its model type is not one transformers supports, so pick another model")
    return UserError(f"the {what} of '{name_or_path}' does not load with transformers {transformers.__version__}: "
                     f"{reason}{advice}")


def _hub_unreachable(err: Exception) -> bool:
    """Whether a hub lookup failed for want of the hub (offline mode, no connection), not for the name."""
    text = str(err).lower()
    return os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in text or "connect" in text


def _not_fetched_error(what: str, name_or_path: str, unreachable: bool) -> UserError:
    hint = (
        "the hub cannot be reached from here; download the model elsewhere and pass its local folder"
        if unreachable
        else "check the spelling, or pass a local folder that holds config.json"
    )
    return UserError(
        f"{what} '{name_or_path}' was not found locally and could not be fetched from the hub: {hint} "
        f"(or use the embedded default '{EMBEDDED_MODEL_NAME}')"
    )


def _hub_lookup_failure(path: str, what: str = "model") -> LocalEntryNotFoundError | None:
    """For a hub name (`path` not a folder) whose `what` ("model", "tokenizer") no cache holds, the error of fetching
    it, where the hub cannot be reached; None where it was fetched or found, or failed for another reason (a name the
    hub does not know, a gated model: the loader says so). Each lookup of a file no cache holds waits out
    huggingface_hub's retries (about 23 s) before it fails, and a loader made two (a model its adapter_config.json,
    then its config.json; a tokenizer its config.json twice): an unreachable hub is said after one lookup, and at once
    for the name's next load with the same hub settings. The folder and the cache are looked at each time, so a
    relative path is judged from the working directory of the call and a copy downloaded since is used."""
    if Path(path).is_dir():
        return None
    file = _uncached_hub_file(path, what)
    if file is None:
        return None
    return _remote_lookup_failure(path, file, hub_constants.HF_HUB_CACHE, hub_constants.ENDPOINT,
                                  hub_constants.is_offline_mode(), os.environ.get("HF_HUB_OFFLINE"))


def _uncached_hub_file(name: str, what: str) -> str | None:
    """The first file that hub name `name`'s `what` loads from and no cache holds: its config.json, then for a
    tokenizer tokenizer_config.json where none of its files (`_TOKENIZER_FILES`) is cached (offline, transformers built
    one from the model type alone: a GPT-2 tokenizer of no vocabulary, or an error asking for sentencepiece). None
    where all are cached, or where `name` is no valid hub name (the loader says so)."""
    needed = [("config.json",), _TOKENIZER_FILES] if what == "tokenizer" else [("config.json",)]
    try:
        for files in needed:
            if not any(isinstance(try_to_load_from_cache(name, file, cache_dir=hub_constants.HF_HUB_CACHE), str)
                       for file in files):
                return files[0]
    except ValueError:
        return None
    return None


@functools.cache
def _remote_lookup_failure(name: str, file: str, cache_dir: str, endpoint: str, offline: bool,
                           offline_env: str | None) -> LocalEntryNotFoundError | None:
    """`_hub_lookup_failure` for a hub name's `file` no cache holds, once a process for the hub settings its outcome
    depends on: the cache folder, the endpoint, offline mode (huggingface_hub's, and the variable `_hub_unreachable`
    reads)."""
    try:
        hf_hub_download(name, file, cache_dir=cache_dir, endpoint=endpoint)
    except LocalEntryNotFoundError as err:
        return err if _hub_unreachable(err) else None
    except (OSError, ValueError):
        return None
    return None


def no_model_error(name_or_path: str) -> UserError:
    """The error for a folder that holds no model: a run that has not saved one yet (checkpoints only), or none."""
    return UserError(f"{name_or_path} holds no model (no config.json there, nor in its model/ folder): a run that has "
                     "not saved its model yet, or no model folder; pass a model folder or the run folder of a finished "
                     "step")


def lora_adapter_base(folder: str | os.PathLike) -> str | None:
    """The base model a folder holding a LoRA adapter alone (a PEFT/TRL save: adapter_config.json, no config.json)
    names; None for any other folder ("" where the adapter names none)."""
    from training.reliability.run_records import read_record  # it builds on this module

    folder = Path(folder)
    if (folder / "config.json").is_file() or not (folder / _ADAPTER_CONFIG).is_file():
        return None
    return str((read_record(folder, _ADAPTER_CONFIG) or {}).get("base_model_name_or_path") or "")


def _local_folder_error(what: str, name_or_path: str, err: Exception) -> UserError:
    """Why the `what` ("model", "tokenizer") of a local folder did not load, in words that say what to pass."""
    folder = Path(resolve_model_path(name_or_path))
    no_tokenizer = what == "tokenizer" and not any((folder / name).is_file() for name in _TOKENIZER_FILES)
    if no_tokenizer:
        reason = f"no {' nor '.join(_TOKENIZER_FILES)}"
    else:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    adapter = lora_adapter_base(folder)
    if adapter is not None:
        return UserError(f"{name_or_path} holds a LoRA adapter, not a whole model: it loads only over its base model "
                         f"{adapter!r} (adapter_config.json), and its {what} did not load ({reason}); merge the adapter "
                         "into its base model and pass that folder, or make the base model loadable by that name")
    if not (folder / "config.json").is_file():
        return no_model_error(name_or_path)
    if no_tokenizer:
        return UserError(f"{name_or_path} holds a model but no tokenizer ({reason}); save the tokenizer into that "
                         "folder, or copy its files from the model it was tuned from")
    return UserError(f"could not load the {what} from {name_or_path}: {reason}")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer whose pad token is real and distinct from EOS.

    Padding shares the EOS id in many checkpoints; masking pad ids would then also mask the EOS the
    model must learn to emit. We reuse `unk` when it is distinct, otherwise add a dedicated pad token
    (the model's embeddings are resized by `load_causal_lm`).
    """
    path = resolve_model_path(name_or_path)
    tokenizer = _hub_call("tokenizer", name_or_path,
                          lambda: AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
                          trust_remote_code)
    if tokenizer.eos_token is None:
        raise UserError(f"the tokenizer of {name_or_path} has no EOS token; set one in its tokenizer_config.json")
    _stop_appending_eos(tokenizer, name_or_path)
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if tokenizer.unk_token is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.add_special_tokens({"pad_token": _PAD_TOKEN})
    tokenizer.padding_side = "right"
    return tokenizer


def _stop_appending_eos(tokenizer: PreTrainedTokenizerBase, name_or_path: str) -> None:
    """A tokenizer that appends its EOS to every text it encodes (Llama's `add_eos_token`) would end every prompt
    in EOS and every answer in two, since this project ends each answer itself (with the EOS, or the chat template's
    end-of-turn token where that is another: `PromptFormatter.stop_token_ids`): the appending is
    turned off where the tokenizer's own switch does exactly that (the encoding otherwise unchanged), and refused
    where it does not."""
    probe = "Hello world"
    appended = tokenizer(probe)["input_ids"]
    if not appended or appended[-1] != tokenizer.eos_token_id:
        return
    if hasattr(tokenizer, "add_eos_token"):
        tokenizer.add_eos_token = False
        if tokenizer(probe)["input_ids"] == appended[:-1]:
            logger.info("the tokenizer of %s appended its EOS to every text; turned off (add_eos_token=False): "
                        "training adds the EOS after each answer itself", name_or_path)
            return
    raise UserError(f"the tokenizer of {name_or_path} appends its EOS token to every text it encodes, so every "
                    "prompt would end in EOS and every answer in two (this project adds the EOS after each answer "
                    "itself); turn it off in its tokenizer (add_eos_token false in tokenizer_config.json, or its "
                    "post_processor in tokenizer.json)")


def load_config(name_or_path: str, trust_remote_code: bool = False):
    path = resolve_model_path(name_or_path)
    return _hub_call("model", name_or_path, lambda: AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                     trust_remote_code)


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability (RLHF needs deterministic log-probs): the `nn.Dropout` modules, the
    probabilities layers copied from the config when they were built and pass to `F.dropout` themselves (OPT's
    decoder layers and attention, Llama's and Qwen's attention, Falcon's and BLOOM's hidden dropout, OPT's layer
    drop), and the config's own. The config's values are remembered for `configs_dropout_as_loaded`."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        _zero_dropout_probabilities(module)
        config = getattr(module, "config", None)
        if config is not None:
            _remember_dropout_as_loaded(config, _zero_dropout_probabilities(config))


# id(config) -> the dropout probabilities `disable_dropout` zeroed in it; an entry leaves with its config
_DROPOUT_AS_LOADED: dict[int, dict[str, float]] = {}


def _zero_dropout_probabilities(holder: object) -> dict[str, float]:
    """Set each dropout probability attribute of `holder` to 0; return the values they had."""
    zeroed = {key: value for key, value in vars(holder).items() if _is_dropout_probability(key, value)}
    for key in zeroed:
        setattr(holder, key, 0.0)
    return zeroed


def _remember_dropout_as_loaded(config: object, zeroed: dict[str, float]) -> None:
    """Keyed by identity (a transformers config is unhashable, and an attribute of its own would be written into
    config.json); a value zeroed earlier is kept, a second `disable_dropout` finding 0."""
    if not zeroed:
        return
    if id(config) not in _DROPOUT_AS_LOADED:
        _DROPOUT_AS_LOADED[id(config)] = {}
        weakref.finalize(config, _DROPOUT_AS_LOADED.pop, id(config), None)
    for key, value in zeroed.items():
        _DROPOUT_AS_LOADED[id(config)].setdefault(key, value)


@contextmanager
def configs_dropout_as_loaded(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the configs of `model` hold the dropout probabilities `disable_dropout` zeroed, so a config.json
    written there keeps the model's own (step 3 and DPO always train without dropout, and a model trained further
    from their folders would otherwise silently get none). The layers keep dropout off."""
    configs = {id(config): config for module in model.modules()
               if (config := getattr(module, "config", None)) is not None and id(config) in _DROPOUT_AS_LOADED}
    training_values = {key: {name: getattr(config, name) for name in _DROPOUT_AS_LOADED[key]}
                       for key, config in configs.items()}
    for key, config in configs.items():
        _set_attributes(config, _DROPOUT_AS_LOADED[key])
    try:
        yield
    finally:
        for key, config in configs.items():
            _set_attributes(config, training_values[key])


def _set_attributes(holder: object, values: dict[str, object]) -> None:
    for name, value in values.items():
        setattr(holder, name, value)


def _is_dropout_probability(name: str, value: object) -> bool:
    """`attention_dropout = 0.1`, `resid_pdrop`, `layerdrop` (not a bool, nor a module: those are handled apart)."""
    return (isinstance(value, float) and value > 0
            and (name.endswith(("dropout", "pdrop", "layerdrop")) or name.startswith("dropout")))


@contextmanager
def zero3_construction(ds_config: dict | None) -> Iterator[None]:
    """Within this context `from_pretrained`/`from_config` build ZeRO-3-partitioned weights when the
    config asks for stage 3. transformers only holds a weak reference to `HfDeepSpeedConfig`, so we
    keep it alive for the duration of the construction."""
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)
    yield
    del keep_alive


def match_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    stop_token_ids: Sequence[int] = ()) -> None:
    """Grow the embeddings to the tokenizer (a pad token may have been added) and record its pad/EOS ids. The
    generation config lists, after the tokenizer's EOS, the other stop ids it listed (Gemma's <end_of_turn>, Phi-3's
    <|end|>) and `stop_token_ids` (those training ends answers at: `PromptFormatter.stop_token_ids`), so a model
    whose turns end at such a token, as training teaches it, stops there wherever it is served."""
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = _stop_ids(tokenizer.eos_token_id, listed_stop_ids(model),
                                                         stop_token_ids)


def listed_stop_ids(model: torch.nn.Module) -> list[int]:
    """The ids `model`'s generation config stops at (its eos_token_id: one id, a list, or none)."""
    return _id_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def folder_stop_ids(name_or_path: str, trust_remote_code: bool = False) -> list[int]:
    """`listed_stop_ids` of the model `name_or_path` loads as, read without loading it (on a rank that holds no copy
    of it): its generation_config.json's eos_token_id, or where it has none, its config's, of which transformers
    then makes the model's generation config."""
    path = resolve_model_path(name_or_path)
    try:
        config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        config = GenerationConfig.from_model_config(load_config(name_or_path, trust_remote_code))
    return _id_list(config.eos_token_id)


def answer_stop_ids(formatter_stop_ids: Sequence[int], model_stop_ids: Sequence[int]) -> list[int]:
    """The ids an answer ends at: the formatter's (`PromptFormatter.stop_token_ids`: the EOS, the chat template's
    end-of-turn token), then every other id the model's generation config stops at (`listed_stop_ids`,
    `folder_stop_ids`: Qwen2.5-Instruct's <|endoftext|> beside its <|im_end|> EOS, Llama-3.1-Instruct's <|eom_id|>),
    each once. A model served as its authors made it stops at each, as transformers' `generate` does; where the
    config lists no other id, the formatter's alone."""
    return list(dict.fromkeys([*formatter_stop_ids, *model_stop_ids]))


def _id_list(ids: int | Sequence[int] | None) -> list[int]:
    return [ids] if isinstance(ids, int) else list(ids or [])


def _stop_ids(eos: int, listed: Sequence[int], added: Sequence[int]) -> int | list[int]:
    """`eos`, then the other ids `listed` and `added`, each once; a lone id stays an int."""
    ids = dict.fromkeys([eos, *listed, *added])
    return list(ids) if len(ids) > 1 else eos


def load_causal_lm(
    name_or_path: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
    ds_config: dict | None = None,
    disable_dropout_layers: bool = False,
    trust_remote_code: bool = False,
    stop_token_ids: Sequence[int] = (),
    **from_pretrained_kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM, ZeRO-3 aware, with embeddings matching the tokenizer and EOS/pad ids set (grown inside the
    ZeRO-3 context: outside it transformers takes the partitioned embedding for a whole, empty one). A step-2 reward
    model is refused: its folder loads as a causal LM with a freshly drawn LM head, and would train or answer with it.
    `stop_token_ids` join its generation config's stop ids (`match_tokenizer`)."""
    from training.core.reward_model import refuse_reward_model  # it builds on this module

    refuse_reward_model(name_or_path)
    path = resolve_model_path(name_or_path)
    with zero3_construction(ds_config):
        model = _hub_call(
            "model",
            name_or_path,
            lambda: AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code, **from_pretrained_kwargs
            ),
            trust_remote_code,
        )
        if tokenizer is not None:
            match_tokenizer(model, tokenizer, stop_token_ids)
    if disable_dropout_layers:
        disable_dropout(model)
    return model
