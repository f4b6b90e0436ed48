"""One module per model family: its config mapping and its key table (Hugging Face tensor -> parameter), registered
by name (`registry`). Adding a family: docs/adding-a-family.md."""
