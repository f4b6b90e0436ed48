"""The install's one native step: the CPU row kernel built for this machine into the package
(mtp_jax/kernels/cpu/kernel_build.py), so that a first run does not compile it. Everything else is in pyproject.toml.
A failed build does not fail the install: a run then builds the kernel itself, or decodes on XLA."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PACKAGE_NATIVE = Path("mtp_jax", "kernels", "cpu", "native", "built")


def _kernel_build():
    spec = importlib.util.spec_from_file_location(
        "kernel_build", ROOT / "mtp_jax" / "kernels" / "cpu" / "kernel_build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildRowKernel(build_ext):
    """Builds the row kernel (a library loaded through ctypes, not a Python module) in place of extensions."""

    def run(self):
        target = ROOT / PACKAGE_NATIVE if self.inplace else Path(self.build_lib) / PACKAGE_NATIVE
        print(_kernel_build().build_installed(target))

    def get_outputs(self):
        return []


setup(
    ext_modules=[Extension("mtp_jax.kernels.cpu.native.row_matmul", sources=[])], cmdclass={"build_ext": BuildRowKernel}
)
