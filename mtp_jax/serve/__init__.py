"""An OpenAI-compatible HTTP server over the decode `Engine` (`python -m mtp_jax.serve`; the command:
mtp_jax/cli/serve.py): the requests it takes (protocol), their prompts (inputs), the engine's thread (worker), text as
it comes (detokenize), the response objects (responses), the app (app, guards), metrics, and uvicorn (server)."""
