"""The default model converted once into the cache folder, and loaded from there afterwards.

Dequantizing the GGUF (and building its tokenizer with transformers) takes seconds on every load; the first load
writes what it read as a converted folder, `<cache>/converted/<gguf name>-<dtype>-<key>/`: the model config, the
parameters as one memory-mapped safetensors file (`params/state_file.py`; weights kept in the GGUF's blocks as
their values, scales and mins), the tokenizer files and `source.json`
(what it was converted from). The key hashes the GGUF's path, size and modification time, the dtype, whether its
blocks are kept, the mtp_jax version and FORMAT: another GGUF, package version or dtype converts afresh.

The folder is written beside its place and renamed into it (`conversion/writer.py`): a killed conversion leaves no
folder that a load reads, and the next conversion removes what it left. A folder that cannot be read back (a tensor
missing, a file cut short) is converted again, with a note; one that cannot be written (a read-only cache) is not
needed: the model is used as read, with a note. Several processes converting at once take turns (a lock file).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys

import jax
import numpy as np
from flax import nnx

from mtp_jax.conversion.convert import config_of
from mtp_jax.conversion.placement import read_params
from mtp_jax.conversion.writer import write_folder
from mtp_jax.loading.default_model import default_gguf_path
from mtp_jax.loading.text_tokenizer import TOKENIZER_JSON, TextTokenizer
from mtp_jax.models.causal_lm import CausalLM
from mtp_jax.parallel.sharding import ShardingRules
from mtp_jax.params.converted import restore_converted
from mtp_jax.params.open_source import open_source
from mtp_jax.params.state_file import STATE_FILE, write_state
from mtp_jax.params.tree import CONFIG_FILE, assemble, nest
from mtp_jax.quant.quantized_array import QuantizedArray
from mtp_jax.runtime.cache_folder import cache_dir
from mtp_jax.runtime.errors import ConversionError

FORMAT = 2  # raise when what a cached folder holds, or how the GGUF is read, changes
SOURCE_FILE = "source.json"  # what the folder was converted from: the fields of its key
CONVERTED = "converted"


def source_fields(gguf: str, dtype, keep_blocks: bool = True) -> dict:
    """What the cached conversion of `gguf` in `dtype` (its blocks kept, or dequantized) depends on."""
    stat = os.stat(gguf)
    return {
        "weights": "as shipped" if keep_blocks else "dequantized",
        "format": FORMAT,
        "mtp_jax": package_version(),
        "gguf": os.path.realpath(gguf),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": np.dtype(dtype).name,
    }


def package_version() -> str:
    try:
        return importlib.metadata.version("mtp_jax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def cached_folder(gguf: str, dtype, keep_blocks: bool = True) -> str:
    """Where the conversion of `gguf` in `dtype` (blocks kept or not) is kept."""
    fields = source_fields(gguf, dtype, keep_blocks)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf))[0]
    return os.path.join(cache_dir(), CONVERTED, f"{stem}-{fields['dtype']}-{key}")


def load_default(dtype, rules: ShardingRules | None, keep_blocks: bool = True) -> tuple[CausalLM, object]:
    """(model, tokenizer) of the default model, from its cached conversion (made now if missing or broken);
    `keep_blocks`: its Q4_1 and Q8_0 weights held in their blocks (`placement.read_params`), else dequantized."""
    gguf = default_gguf_path()
    if jax.process_count() > 1:  # every process would write the cache: each reads the GGUF instead
        return read_gguf(gguf, dtype, rules, keep_blocks)
    folder = cached_folder(gguf, dtype, keep_blocks)
    loaded = read_cached(folder, gguf, dtype, rules, keep_blocks)
    if loaded is not None:
        return loaded
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        lock = open(f"{folder}.lock", "w")
    except OSError as e:
        return cannot_keep(folder, e, read_gguf(gguf, dtype, rules, keep_blocks))
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting: wait, then use its folder
        loaded = read_cached(folder, gguf, dtype, rules, keep_blocks)
        if loaded is not None:
            return loaded
        print(f"mtp_jax: converting the default model once into {folder}", file=sys.stderr)
        model, tokenizer = read_gguf(gguf, dtype, None, keep_blocks)
        try:
            write_cached(folder, model, tokenizer, source_fields(gguf, dtype, keep_blocks))
        except (OSError, ConversionError) as e:
            reread = (model, tokenizer) if rules is None else read_gguf(gguf, dtype, rules, keep_blocks)
            return cannot_keep(folder, e, reread)
    tokenizer = TextTokenizer.from_folder(folder)  # the tokenizer every later load reads
    if rules is None:
        return model, tokenizer
    return restore_converted(folder, dtype, rules), tokenizer  # placed straight into the shardings


def cannot_keep(folder: str, error: Exception, loaded: tuple[CausalLM, object]) -> tuple[CausalLM, object]:
    """`loaded`, after a note that the cache could not be written."""
    print(f"mtp_jax: cannot keep the converted default model in {folder} ({error}); the GGUF is read on every run",
          file=sys.stderr)  # fmt: skip
    return loaded


def read_gguf(gguf: str, dtype, rules: ShardingRules | None, keep_blocks: bool = True) -> tuple[CausalLM, object]:
    """(model, transformers tokenizer) read from the GGUF itself; the tokenizer (most of it importing transformers)
    on a second thread while the weights are read."""
    source = open_source(gguf)
    cfg = config_of(source)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtp_jax-tokenizer") as pool:
        tokenizer = pool.submit(source.load_tokenizer)
        params = read_params(source, cfg, dtype, rules, keep_blocks=keep_blocks)
        return assemble(cfg, nest(params), dtype, rules), tokenizer.result()


def read_cached(
    folder: str, gguf: str, dtype, rules: ShardingRules | None, keep_blocks: bool = True
) -> tuple[CausalLM, object] | None:
    """(model, tokenizer) from the cached folder; None when there is none. A folder that is not whole or not of
    this source is removed (under the caller's lock, or harmlessly: writers rename whole folders into place)."""
    if not os.path.isdir(folder):
        return None
    try:
        with open(os.path.join(folder, SOURCE_FILE), encoding="utf-8") as f:
            if json.load(f) != source_fields(gguf, dtype, keep_blocks):
                raise ConversionError(f"{folder}: converted from another source")
        model = restore_converted(folder, dtype, rules)
        return model, TextTokenizer.from_folder(folder)
    except (OSError, ValueError, ConversionError) as e:
        print(f"mtp_jax: the cached default model cannot be used ({e}); converting it again", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def write_cached(folder: str, model: CausalLM, tokenizer, fields: dict) -> None:
    """Write the converted folder of `model` (on one device) and its transformers `tokenizer`, atomically."""
    params = {}
    for path, v in nnx.to_flat_state(nnx.state(model)):
        path, value = tuple(str(p) for p in path), v.get_value()
        if isinstance(value, QuantizedArray):  # as stored: path/values, path/scales (and path/mins)
            value = value.as_stored()
            parts = {"values": value.values, "scales": value.scales, "mins": value.mins}
            params |= {(*path, part): np.asarray(a) for part, a in parts.items() if a is not None}
        else:
            params[path] = np.asarray(value)

    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(model.config.to_json())
        tokenizer.save_pretrained(tmp)
        if not os.path.isfile(os.path.join(tmp, TOKENIZER_JSON)):
            raise ConversionError(f"the default model's tokenizer wrote no {TOKENIZER_JSON}")
        write_state(os.path.join(tmp, STATE_FILE), params)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump(fields, f, indent=2)  # last: a folder without it is never used

    write_folder(folder, True, fill)
