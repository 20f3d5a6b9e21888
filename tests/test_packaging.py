"""The editable install exposes exactly the modules a wheel installs.

``passes/`` and ``lowerings/`` live at the repository root and install as
``hyscale_compile.passes`` / ``hyscale_compile.lowerings``; an editable install must not make
the rest of the checkout (``tests``, ``benchmarks``, the root's own ``hyscale_compile/``)
importable under ``hyscale_compile``. Both installs are made from a copy of the checkout into
temporary directories, with the README's flags, and walked with ``pkgutil.walk_packages`` in
a fresh interpreter whose working directory is not the checkout.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a subprocess: argv[1] is the install's directory. Only that install of
# hyscale_compile may be seen, so any other editable one the environment has (its .pth
# finder, whose module has the same name as this install's, link tree or path hook entry) is
# dropped first, and the install goes first on sys.path; addsitedir runs the install's .pth
# files, as the interpreter does for site-packages.
_WALK = r"""
import importlib.util, json, pkgutil, site, sys
target = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable___hyscale_compile")]
sys.path[:] = [p for p in sys.path if "__editable__.hyscale_compile" not in p]
for name in [m for m in sys.modules if m.startswith("__editable___hyscale_compile")]:
    del sys.modules[name]
before = list(sys.path)
sys.path.insert(0, target)
site.addsitedir(target)
sys.path[:] = [p for p in sys.path if p not in before] + before
import hyscale_compile
out = {"file": hyscale_compile.__file__, "path": list(hyscale_compile.__path__)}
try:
    out["modules"] = sorted(m.name for m in pkgutil.walk_packages(hyscale_compile.__path__, "hyscale_compile."))
except RecursionError:
    out["modules"] = "RecursionError"
out["extra"] = [n for n in ("hyscale_compile.tests", "hyscale_compile.hyscale_compile", "hyscale_compile.benchmarks")
                if importlib.util.find_spec(n) is not None]
print(json.dumps(out))
"""


def _pip(*args, cwd):
    out = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def _walk(target, cwd):
    out = subprocess.run([sys.executable, "-I", "-c", _WALK, target], capture_output=True, text=True, cwd=cwd,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None,
                    reason="needs pip and setuptools (the install's own build backend, no build isolation)")
def test_editable_install_exposes_the_wheels_modules(tmp_path):
    # a copy, so that neither build writes into the checkout (a stale build/lib would leak
    # deleted modules into the wheel) and the environment's own install is left alone
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", "out", ".whl"))
    work = tmp_path / "cwd"
    work.mkdir()
    flags = ("--no-deps", "--no-build-isolation", "-q")
    _pip("wheel", *flags, str(src), "-w", str(tmp_path / "dist"), cwd=work)
    wheel = glob.glob(str(tmp_path / "dist" / "hyscale_compile-*.whl"))
    assert len(wheel) == 1, wheel
    _pip("install", *flags, "--no-index", "--target", str(tmp_path / "wheel"), wheel[0], cwd=work)
    _pip("install", *flags, "--target", str(tmp_path / "editable"), "-e", str(src), cwd=work)

    from_wheel = _walk(str(tmp_path / "wheel"), work)
    from_editable = _walk(str(tmp_path / "editable"), work)
    assert from_wheel["file"].startswith(str(tmp_path / "wheel")), from_wheel
    # the editable install's files are the copy's (through a link tree or a finder)
    assert os.path.realpath(from_editable["file"]).startswith(os.path.realpath(src)), from_editable
    assert from_wheel["extra"] == [] and from_editable["extra"] == [], (from_wheel, from_editable)
    assert {"hyscale_compile.backend", "hyscale_compile.passes.canonicalize",
            "hyscale_compile.lowerings.ops"} <= set(from_wheel["modules"]), from_wheel
    assert from_editable["modules"] == from_wheel["modules"], (from_editable, from_wheel)


_CHECKOUT = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])  # as the benchmarks and the tests run: the checkout first
import hyscale_compile, hyscale_compile.lowerings.ops, hyscale_compile.passes.canonicalize
print(json.dumps({"file": hyscale_compile.__file__, "lowerings": hyscale_compile.lowerings.__file__,
                  "passes": hyscale_compile.passes.__file__,
                  "extra": [n for n in ("hyscale_compile.tests", "hyscale_compile.hyscale_compile",
                                        "hyscale_compile.benchmarks") if importlib.util.find_spec(n) is not None]}))
"""


def test_source_checkout_maps_only_the_two_subpackages(tmp_path):
    # Run from the checkout without an install, hyscale_compile/ makes the root's passes/ and
    # lowerings/ its subpackages, and nothing else of the root.
    out = subprocess.run([sys.executable, "-I", "-c", _CHECKOUT, ROOT], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["file"] == os.path.join(ROOT, "hyscale_compile", "__init__.py"), got
    assert got["lowerings"] == os.path.join(ROOT, "lowerings", "__init__.py"), got
    assert got["passes"] == os.path.join(ROOT, "passes", "__init__.py"), got
    assert got["extra"] == [], got
