"""The row kernel and the decode attention at every x86-64 level this CPU can run, each against exact references
(tests/kernels/native/row_kernel_check.cc: every weight form and layout, a row's bits alone and in any pass): native,
and the levels users' CPUs have below it, built here with `-march` (as MTP_JAX_NATIVE_MARCH builds the library). Each
build names its level, so a build that fell back to slower code than its level allows fails here."""

from __future__ import annotations

import pytest

from mtp_jax.kernels.cpu import kernel_build
from tests.kernels.native.levels import build_and_run, isa_of, x86_host_or_skip

pytestmark = pytest.mark.slow

LEVELS = [  # -march, the code path it must take, the CPU flags it needs
    ("x86-64-v3", "avx2", {"avx2", "fma", "f16c"}),
    ("x86-64-v2", "sse4", {"sse4_1", "sse4_2", "ssse3", "popcnt"}),
    ("x86-64", "generic", set()),
]


@pytest.mark.native
@pytest.mark.parametrize("march, isa, needs", LEVELS, ids=[level[0] for level in LEVELS])
def test_a_level_below_native_agrees_with_the_references(tmp_path, march, isa, needs):
    x86_host_or_skip(needs)
    output = build_and_run(tmp_path, kernel_build.compiler(), march, [])
    assert isa_of(output) == isa


@pytest.mark.native
def test_the_native_build_agrees_with_the_references(tmp_path):
    x86_host_or_skip(set())
    output = build_and_run(tmp_path, kernel_build.compiler(), "native", [])
    assert isa_of(output) in ("avx512", "avx2", "sse4", "generic")
