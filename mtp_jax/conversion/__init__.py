"""Checkpoint -> parameters with strict accounting (`convert`), read onto devices (`placement`), written atomically
(`writer`); parameters -> Hugging Face tensors (`export`)."""
