"""`params.gguf_file`: the same metadata, tensors and dequantized values as the `gguf` package's own reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mtp_jax.params.gguf_file import WHOLE_TENSOR, GGUFFile, dequantize


def same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (b.name, b.tensor_type, b.n_bytes, b.data_offset)
        assert a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_a_written_file_reads_as_gguf_reads_it(tmp_path):
    path = str(tmp_path / "small.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("some.flag", True)
    writer.add_string("tokenizer.chat_template", "{{ messages }} ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>", "é"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 0.0])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    values = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("q", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_as_gguf_reader(path)


@pytest.mark.slow
def test_the_default_model_reads_as_gguf_reads_it(smollm2_path):
    same_as_gguf_reader(smollm2_path)


@pytest.mark.parametrize("tensor_type", sorted(WHOLE_TENSOR, key=lambda t: t.name), ids=lambda t: t.name)
def test_dequantize_equals_gguf(tensor_type):
    values = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32)  # [rows, row length]
    data = gguf.quants.quantize(values, tensor_type)  # [rows, bytes per row]
    expected = gguf.quants.dequantize(data, tensor_type).astype(np.float32)
    got = dequantize(data, tensor_type)
    assert got.dtype == np.float32 and got.shape == values.shape and np.array_equal(got, expected)


def test_a_file_cut_short_is_refused(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(1000))  # inside the tokenizer's metadata
    with pytest.raises(ValueError, match="cut short"):
        GGUFFile(str(cut))
