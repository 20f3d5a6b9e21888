import os
import sys

# Triton decides interpreted vs compiled once per process, when it is first imported (and
# torch/_inductor imports it early). On a machine without a GPU, run every Triton kernel
# under the interpreter so the kernel tests run on the CPU; on a GPU machine leave it unset.
def _has_cuda_device() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


if not _has_cuda_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The generated kernels of a test run go to a temporary directory (inherited by the tests'
# subprocesses), not ~/.cache: a run never reads kernel files another checkout wrote.
if "HYSCALE_KERNEL_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HYSCALE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="hyscale-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["HYSCALE_KERNEL_CACHE"], ignore_errors=True)

# Inductor's caches too, one per test process (each pytest-xdist worker): a compile that hits
# a graph another run or worker cached skips the passes, so a test that reads the pass's
# records would find none
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyscale-test-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# the repository root on sys.path so tests can import tests.contract / tests.models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# setuptools before anything imports the standard library's distutils: megatron-core imports
# torch.utils.cpp_extension, whose setuptools import asserts (``_distutils_hack``) when the
# standard library's distutils was imported first in the same process (seen when
# tests/test_packaging.py ran before the Megatron tests in one xdist worker)
try:
    import setuptools  # noqa: E402,F401
except ImportError:
    pass

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
