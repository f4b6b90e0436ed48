"""What `python -m mtp_jax.bench` times besides our decoding: the peers (`peers`: transformers, llama.cpp), the
timing itself (`timing`) and where it ran (`environment`). The command: cli/bench.py."""
