"""Models and DeepSpeed: loading, the reward/critic model, LoRA, engines, optimizers, saving."""
from training.core.args import (
    ModelSource,
    ModelTrainingConfig,
    RunArguments,
    ScheduleSettings,
    SettingsParser,
    apply_model_options,
    check_positive,
    flag_values,
    group,
    optimization_settings,
)
from training.core.ds_config import get_eval_ds_config, get_train_ds_config
from training.core.embedded_model import (
    EMBEDDED_MODEL_NAME,
    embedded_model_path,
    is_embedded_name,
)
from training.core.engine import (
    OptimizationSettings,
    create_frozen_engine,
    create_reference_engine,
    create_train_engine,
)
from training.core.lora import apply_lora, lora_target_modules
from training.core.model_loading import (
    FINAL_MODEL_SUBDIR,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from training.core.reward_model import MARKER_FILE, VALUE_HEAD_FILE, RewardModel, is_reward_model_dir
from training.core.save import gathered_state_dict, save_hf_model, unwrap
from training.core.sequences import answer_logprobs, last_token_index, position_ids_from_attention_mask, token_logprobs
from training.core.zero import full_numel, full_shape, is_zero3_module, is_zero3_param
