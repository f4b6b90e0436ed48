"""Training MTP heads on a frozen trunk (`head_training`), their teacher-forced acceptance (`acceptance`), and the
offline prompts for self-distillation (`prompt_builder`)."""
