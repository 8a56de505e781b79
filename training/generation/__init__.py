"""Generation: the `hf` generator and the hybrid engine (ZeRO training <-> fast decoding of one actor)."""
