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


def _patch_the_interpreter_once_per_launch() -> None:
    """The Triton interpreter patches triton.language's builtins for a kernel launch and
    again, in full, at every call of a @triton.jit helper inside it (``inspect.getmembers``
    over the language modules: half the time of an interpreted HyTopK test). Inside a launch
    a helper that sees only modules the launch already patched finds nothing left to patch
    (its builtins are the launch's wrappers, the rest is reset to equal functions), so the
    repeated patch is skipped there; a helper that sees another language module is patched as
    before. Only where the interpreter has the shape this relies on."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    if not all(hasattr(ti, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")):
        return
    real_patch, real_call = ti._patch_lang, ti.GridExecutor.__call__
    launch: dict = {"depth": 0, "langs": set()}
    seen: dict = {}  # function -> the language modules its globals hold

    def patch_lang(fn):
        if launch["depth"]:
            langs = seen.get(fn)
            if langs is None:
                langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (ti.tl, ti.tl.core))
            if langs and langs <= launch["langs"]:  # (none: the interpreter's own assertion)
                return ti._LangPatchScope()
            launch["langs"] |= langs
        return real_patch(fn)

    def grid_call(self, *args, **kwargs):
        outer = launch["depth"], launch["langs"]
        launch["depth"], launch["langs"] = outer[0] + 1, set()
        try:
            return real_call(self, *args, **kwargs)
        finally:
            launch["depth"], launch["langs"] = outer

    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = grid_call


if os.environ.get("TRITON_INTERPRET") == "1":
    import inspect

    _patch_the_interpreter_once_per_launch()

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
