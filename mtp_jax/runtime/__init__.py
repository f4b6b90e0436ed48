"""What every layer leans on: the error types and one-line reporting (`errors`), files written whole (`files`), which
JAX platforms start (`platforms`), flax and transformers imported lightly, the cache folder and JAX's persistent
compilation cache."""
