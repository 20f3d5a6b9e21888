import os
import sys

# Triton decides interpreted vs compiled once per process, when it is first imported (and
# torch/_inductor imports it early). On a machine without a GPU, run every Triton kernel
# under the interpreter so the kernel tests run on the CPU; on a GPU machine leave it unset.
def _has_cuda_device() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


if not _has_cuda_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process (inherited by the tests' subprocesses): the suite runs
# one pytest-xdist worker per core, and a second OpenMP thread per worker only contends with
# the other worker (its threads spin between the small ops of a test: 15% more wall time on
# the 2-core CI machine). Set before torch is imported; torch.set_num_threads below covers a
# torch that a plugin imported first.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


def _one_dtype_table_for_the_interpreter() -> None:
    """The interpreter's ``_get_np_dtype`` builds its table of 19 Triton dtypes at every call
    (hashing each key): a quarter of a million calls, about 10% of an interpreted backward
    test's time. Its answer depends only on the (hashable) dtype, so each dtype's answer is
    kept after the first call; unhashable arguments go to the original."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    real = getattr(ti, "_get_np_dtype", None)
    if real is None:
        return
    seen: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return seen[tt_dtype]
        except KeyError:
            out = seen[tt_dtype] = real(tt_dtype)
            return out
        except TypeError:
            return real(tt_dtype)

    ti._get_np_dtype = get_np_dtype


def _xor_sum_by_numpy_in_the_interpreter() -> None:
    """The interpreter runs a reduction whose combine function it does not know element by
    element in Python (``generic_reduce``: about 20 ms a call); ``tl.xor_sum``, which the sort
    networks' compare-and-swap steps use, is one of them (a fifth of an interpreted HyTopK
    test's time). XOR is exact and associative, so numpy's ``bitwise_xor.reduce`` gives the
    same integers; other reductions, and a reduction over all axes, go to the original."""
    try:
        import numpy as np
        from triton.language import standard
        from triton.runtime import interpreter as ti
    except Exception:
        return
    xor = getattr(standard, "_xor_combine", None)
    real = getattr(getattr(ti, "ReduceOps", None), "apply_impl", None)
    if xor is None or real is None:
        return

    def apply_impl(self, input):
        if self.combine_fn == xor and self.axis is not None and len(input) == 1:
            x = input[0]
            out = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(out, x.dtype)
        return real(self, input)

    ti.ReduceOps.apply_impl = apply_impl


def _one_shape_per_block_shape_in_the_interpreter() -> None:
    """Every value the interpreter computes is a new ``tl.tensor``, whose constructor builds its
    shape as a ``tl.tuple`` of constexprs, and that tuple's type builds its name string: about a
    fifth of an interpreted kernel test's time goes there (1.3 million tensors in two HyTopK
    tests). The shape and element count depend only on the block shape, and nothing mutates
    them, so each block shape's are built once and shared; the rest of the constructor is the
    original's."""
    try:
        import math

        from triton.language import core
    except Exception:
        return
    src = getattr(core.tensor.__init__, "__code__", None)
    # the constructor this replaces: handle, shape, numel, type, dtype
    if src is None or src.co_varnames[:3] != ("self", "handle", "type") or not hasattr(core, "tuple"):
        return
    shapes: dict = {}

    def shapes_of(dims):
        return core.constexpr(math.prod(dims)), core.tuple([core.constexpr(s) for s in dims])

    def __init__(self, handle, type):
        self.handle = handle
        dims = tuple(type.shape) if type.is_block() else ()
        try:
            got = shapes.get(dims)
        except TypeError:  # an unhashable dimension: built as the original builds it
            got = shapes_of(dims)
        if got is None:
            got = shapes[dims] = shapes_of(dims)
        self.numel, self.shape = got
        self.type = type
        self.dtype = type.scalar

    core.tensor.__init__ = __init__

    # Each value's block type is new too, and builds the same tuple, name string and shape
    # check: one per (element type, shape) is built by the original, the rest copy its fields.
    # Unhashable element types go to the original.
    block_init = core.block_type.__init__
    blocks: dict = {}

    def block_type_init(self, element_ty, shape):
        try:
            key = (element_ty, type(shape), tuple(s.value if type(s) is core.constexpr else s for s in shape))
            got = blocks.get(key)
        except TypeError:
            return block_init(self, element_ty, shape)
        if got is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = got

    core.block_type.__init__ = block_type_init

    # Called on every argument of every language function: the common cases (a constexpr, a
    # tensor, a Python scalar) answered before the original's four isinstance tests.
    unwrap = core._unwrap_if_constexpr
    plain = (core.tensor, int, float, bool, str, type(None))

    def unwrap_if_constexpr(o):
        t = type(o)
        if t is core.constexpr:
            return o.value
        if t in plain:
            return o
        return unwrap(o)

    core._unwrap_if_constexpr = unwrap_if_constexpr


if os.environ.get("TRITON_INTERPRET") == "1":
    import inspect

    _patch_the_interpreter_once_per_launch()
    _one_dtype_table_for_the_interpreter()
    _xor_sum_by_numpy_in_the_interpreter()
    _one_shape_per_block_shape_in_the_interpreter()

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

if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The suite's longest tests (tens of seconds each on the 2-core CI machine: offline sm_90
# builds, fresh processes, full Inductor compiles), most expensive first. They are run first,
# so that under pytest-xdist the short tests fill the workers' ends instead of one worker
# finishing a long test alone; the order of everything else is the collection's. The suite's
# command (README.md, .ci/run) adds --dist worksteal, so an idle worker takes queued tests
# from the other: on a quiet 2-core machine 651 s against 800 s with the default scheduling.
_LONGEST_FIRST = (
    "tests/test_train_example.py::test_train_dsa_meets_the_targets",
    "tests/test_kernel_compiles.py::test_mask_kernels",
    "tests/test_kernel_compiles.py::test_sort_rows",
    "tests/test_registry.py::test_a_cached_graph_in_a_fresh_process",
    "tests/test_triton_attention.py::test_kernels_compile_for_sm90_offline",
    "tests/test_kernel_compiles.py::test_fp32",
    "tests/test_inductor_e2e.py::test_hf_models_through_inductor",
    "tests/test_kernel_compiles.py::",
    "tests/test_examples.py::test_demo_quick",
    "tests/test_triton_attention.py::test_prefetch_idx_pipelines_the_gather",
    "tests/test_backend.py::test_entry_point_hyscale_without_import",
    "tests/test_distributed.py::",
    "tests/test_triton_attention_backward.py::test_latent_kernels_compile",
    "tests/test_hf_models.py::test_hf_model_rewritten_and_equal[deepseek_v4",
    "tests/test_attention_models.py::test_v32_dynamic_training_step",
    "tests/test_triton_hytopk.py::test_sort_after_same_bits",
    "tests/test_megatron.py::test_megatron_indexer_is_fused",
    "tests/test_triton_hytopk.py::test_presample",
    "tests/test_inductor_e2e.py::",
    "tests/test_mla.py::test_inductor",
    "tests/test_triton_hytopk.py::test_sliding_window_and_tile_skipping",
)


def _cost_rank(item) -> int:
    nodeid = item.nodeid.replace("\\", "/")
    return next((i for i, p in enumerate(_LONGEST_FIRST) if nodeid.startswith(p)), len(_LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_cost_rank)  # (stable: the rest keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
