"""Frozen, hashable configurations: the model's shape (`model.ModelConfig`, built from a Hugging Face config.json by
`families.registry.model_config_from_hf`) and the decode settings (`decode.DecodeConfig`). Both are static
arguments of jitted functions."""
