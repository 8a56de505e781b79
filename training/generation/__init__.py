"""Generation: the `hf` generator and the hybrid engine (ZeRO training <-> fast decoding of one actor)."""
from training.generation.cpu_linear import (
    LinearWeight,
    PackedLinear,
    onednn_packing_available,
    pack_linear_layers,
)
from training.generation.fused_llama import fused_llama_unsupported_reason
from training.generation.generator import (
    DecodingSettings,
    GenerationConfig,
    GenerationOutput,
    Generator,
    HFGenerator,
    SamplingSettings,
    eval_mode,
)
from training.generation.hybrid_engine import (
    HybridEngine,
    HybridEngineSettings,
    build_generator,
)
