"""The row kernel and the decode attention for AArch64 (NEON, and NEON with dotprod), cross-compiled and run under
qemu-user on other hosts, against the same exact references as every x86-64 level
(tests/kernels/native/row_kernel_check.cc). Skips, saying which, where the cross compiler or qemu-user is not
installed."""

from __future__ import annotations

import pytest

from tests.kernels.native.levels import build_and_run, cross_or_skip, isa_of

pytestmark = pytest.mark.slow

COMPILER, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"
LEVELS = [("armv8-a", "neon"), ("armv8.2-a+dotprod", "neon-dotprod")]


@pytest.mark.native
@pytest.mark.parametrize("march, isa", LEVELS, ids=[level[0] for level in LEVELS])
def test_an_arm_level_agrees_with_the_references(tmp_path, march, isa):
    runner = cross_or_skip(COMPILER, EMULATOR)
    output = build_and_run(tmp_path, COMPILER if runner else "g++", march, runner, extra=("-static",) if runner else ())
    assert isa_of(output) == isa
