"""Checkpoints as sources of tensors under Hugging Face names (safetensors folders, GGUF files, fp8 releases) and the
converted folders this project writes and reads back; the parameter tree without the model."""
