"""`load_model` and `load` (`checkpoint`): a converted folder, a Hugging Face folder or repo id (`hub`), a .gguf, or
the default model (`default_model`, converted once into the cache: `default_conversion`); MTP heads trained here
(`heads`); tokenizers (`text_tokenizer`)."""
