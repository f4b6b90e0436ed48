"""How a checkpoint tensor becomes a parameter: transforms (our layout from the HF one, and the HF shape each
expects) and `Target`, the parameter slot a tensor fills. Family key tables (mtp_jax/families/) are made of these.

A transform turns the HF tensor into our layout and states the HF shape it expects, so every tensor's shape is
checked against the target parameter before it is used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Linear:
    """HF linear weight [out, in] -> our kernel `in_dims + out_dims`; `num_in` leading target dims are inputs."""

    num_in: int = 1

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(target[self.num_in :]), math.prod(target[: self.num_in]))

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.T.reshape(target)


@dataclasses.dataclass(frozen=True)
class Reshape:
    """A norm weight, a bias ([N*H] -> [N, H]) or an embedding: same values, our shape."""

    flat: bool = True

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(target),) if self.flat else target

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.reshape(target)


COPY = Reshape(flat=False)
FLAT = Reshape(flat=True)


@dataclasses.dataclass(frozen=True)
class Transposed:
    """An HF tensor whose axes are ours permuted: ours = hf.transpose(axes) (a self-inverse permutation)."""

    axes: tuple[int, ...]

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(target[a] for a in self.axes)

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w.transpose(self.axes)


@dataclasses.dataclass(frozen=True)
class DepthwiseConv:
    """conv1d.weight [C, 1, W] -> [W, C]."""

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return (target[1], 1, target[0])

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return w[:, 0, :].T


@dataclasses.dataclass(frozen=True)
class Part:
    """Part `part` of an HF tensor of shape `shape` that holds several of our parameters; `split(w)` returns all
    of them in our layout (e.g. mtp_jax/families/qwen_hybrid_layout.py)."""

    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    part: int
    shape: tuple[int, ...]

    def hf_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        return self.shape

    def __call__(self, w: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
        return self.split(w)[self.part].reshape(target)


# Every tensor a key table maps is a floating-point weight, stored in one of these (fp8 ones dequantized on read).
WEIGHT_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


Transform = Linear | Reshape | Transposed | DepthwiseConv | Part


@dataclasses.dataclass(frozen=True)
class Target:
    """The parameter slot one checkpoint tensor fills, and how."""

    path: tuple[str, ...]  # parameter path in the model's state
    index: tuple[int, ...]  # slot on the leading stacked axes: () whole, (layer,), (layer, expert)
    transform: Transform
