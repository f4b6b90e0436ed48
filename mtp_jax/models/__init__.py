"""The models: blocks (attention, latent attention, gated DeltaNet, MLPs and mixtures of experts), the decoder and its
MTP head (`causal_lm`), hybrid trunks (`hybrid_stack`), and the fixed-shape caches they decode over (`kv_cache`,
`cache_attention`)."""
