"""The decode loop: `generate` (`speculative`) as one jitted `lax.while_loop` of draft/verify rounds (`rounds`,
`loop_state`, `prefill`), sampling and acceptance (`sampling`), adaptive draft length (`adaptive`), the default
drafting (`default_drafting`), compiled programs kept on disk (`executable_cache`), and text in and out (`text`,
`text_stream`, `prompts`, `stats`). `python -m mtp_jax.decode` runs the command in cli/decode.py."""
