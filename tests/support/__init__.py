"""What the tests share, not tests themselves: tiny models, prompts, checkpoints written for a test, the child
processes of the multi-device tests, the repository's root."""
