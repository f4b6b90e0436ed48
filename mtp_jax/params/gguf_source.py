"""A llama.cpp GGUF file seen as a Hugging Face checkpoint: HF config, HF tensor names, HF layouts.

The file is memory-mapped (`gguf_file.GGUFFile`); a quantized tensor is dequantized to float32 only when it is
read, one tensor at a time. GGUF lists dimensions fastest-first, so NumPy shapes are the reversed GGUF shapes,
which is already the PyTorch [out, in] layout. For `llama` files llama.cpp's convert script reorders the rows
of the q and k projections (rotary halves -> interleaved pairs); `read` undoes that.
"""

from __future__ import annotations

import os
import re
import struct

import gguf
import ml_dtypes
import numpy as np

from mtp_jax.params.gguf_file import GGUFFile, block_parts, dequantize
from mtp_jax.params.source import CheckpointSource
from mtp_jax.runtime.errors import ConversionError
from mtp_jax.runtime.transformers_import import import_transformers

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
HF_ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
UNMAPPED_PREFIX = "gguf:"

Q = gguf.GGMLQuantizationType
STORED_AS_IS = (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64)
_REQUIRED = object()


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor, or `gguf:<name>` when it has no HF counterpart."""
    stem, dot, kind = gguf_name.rpartition(".")
    if dot and kind in ("weight", "bias") and stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"
    return UNMAPPED_PREFIX + gguf_name


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, row 2i + j goes back to row j * head_dim/2 + i.

    w: [num_heads * head_dim, ...] (a weight [out, in] or a bias [out]).
    """
    half = w.shape[0] // num_heads // 2
    # [H, head_dim/2, 2, ...] (interleaved pairs) -> [H, 2, head_dim/2, ...] (rotate-half halves)
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(CheckpointSource):
    """A `.gguf` file (llama / qwen2 / qwen3) under Hugging Face names and layouts."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = GGUFFile(path)
        except OSError as e:
            raise ConversionError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None
        except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConversionError(f"{path}: corrupt or truncated GGUF file ({reason})") from None
        self.architecture = self._field("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConversionError(
                f"{path}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors = {hf_tensor_name(t.name): t for t in self._file.tensors}
        self._config = self._build_config()

    def _field(self, key: str, default=_REQUIRED):
        if key not in self._file.fields:
            if default is _REQUIRED:
                raise ConversionError(f"{self.path}: GGUF metadata has no {key}")
            return default
        return self._file.fields[key]

    def _build_config(self) -> dict:
        arch = self.architecture
        scaling = self._field(f"{arch}.rope.scaling.type", None)
        if scaling not in (None, "none"):
            raise ConversionError(f"{self.path}: rope scaling {scaling!r} is not supported yet")
        if "gguf:rope_freqs.weight" in self._tensors:
            raise ConversionError(f"{self.path}: rope scaling via a rope_freqs tensor is not supported yet")
        hidden = int(self._field(f"{arch}.embedding_length"))
        heads = int(self._field(f"{arch}.attention.head_count"))
        vocab = self._field(f"{arch}.vocab_size", None)
        if vocab is None:
            vocab = len(self._field("tokenizer.ggml.tokens"))
        return {
            "architectures": [HF_ARCHITECTURE_CLASSES[arch]],
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(self._field(f"{arch}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._field(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._field(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{arch}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", None),
            "hidden_act": "silu",
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
        }

    @property
    def hf_config(self) -> dict:
        return dict(self._config)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def block_format(self, name: str) -> str | None:
        """The GGUF block format tensor `name` is stored in, where `quant.SHIPPED_BLOCKS` can hold it as it is
        ("Q4_1", "Q8_0"); None for any other."""
        kind = self._tensors[name].tensor_type
        return kind.name if kind in (Q.Q4_1, Q.Q8_0) else None

    def read_stored_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Tensor `name`, stored in a format `block_format` names, as its blocks hold it (w = level * scale + min):
        levels [*shape] (Q4_1: uint8 0..15, Q8_0: int8) and, per block of 32 along the last axis, the float16 scale
        and (Q4_1) min [*shape[:-1], shape[-1] // 32]; llama's q/k rows put back as `read` puts them."""
        t = self._tensors[name]
        levels, scales, mins = block_parts(t.data, t.tensor_type, self.shape(name))
        return tuple(None if a is None else self._unpermute(name, a) for a in (levels, scales, mins))

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        shape = self.shape(name)
        if t.tensor_type in STORED_AS_IS:
            array = t.data.reshape(shape)
        elif t.tensor_type == Q.BF16:
            array = t.data.view(ml_dtypes.bfloat16).reshape(shape)
        else:
            try:
                array = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ConversionError(
                    f"{self.path}: tensor {t.name} has unsupported GGUF type {t.tensor_type.name}"
                ) from None
            array = array.reshape(shape)
        return self._unpermute(name, array)

    def _unpermute(self, name: str, array: np.ndarray) -> np.ndarray:
        if self.architecture != "llama":
            return array
        if ".self_attn.q_proj." in name:
            return unpermute_rotary_rows(array, self._config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_rotary_rows(array, self._config["num_key_value_heads"])
        return array

    def _tokenizer_without_torch(self):
        """transformers' GGUF tokenizer builder fed with metadata read here: its own GGUF reader imports torch,
        which the library does not require. None when this transformers version lacks the builder."""
        try:
            PreTrainedTokenizerFast = import_transformers().PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:
            return None
        groups = {
            group: {new: self._field(f"tokenizer.{old}") for old, new in renames.items()
                    if f"tokenizer.{old}" in self._file.fields}
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }  # fmt: skip
        tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
        if tokenizer_dict.get("tokenizer_type") == "llama":
            tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece files
        for name in ("bos", "eos", "unknown", "padding"):
            token_id = self._field(f"tokenizer.ggml.{name}_token_id", None)
            key = {"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"
            tokenizer_config[key] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(self.architecture, tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)

    def load_tokenizer(self):
        folder, filename = os.path.split(os.path.abspath(self.path))
        try:
            tokenizer = self._tokenizer_without_torch()
            if tokenizer is None:
                tokenizer = import_transformers().AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        except (ValueError, KeyError, OSError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConversionError(f"{self.path}: cannot build a tokenizer from the GGUF ({reason})") from None
        template = self._field("tokenizer.chat_template", None)
        if template:
            tokenizer.chat_template = template
        eos_id = self._config["eos_token_id"]
        if eos_id is not None and tokenizer.eos_token_id != eos_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        return tokenizer
