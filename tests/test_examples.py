"""Smoke tests of ``examples/demo.py`` (the project's main demo), run as a user runs it."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def run_demo(*flags, timeout):
    return subprocess.run(
        [sys.executable, DEMO, *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.inductor
def test_demo_quick():
    # About 25 s on 2 busy CPU cores with cold Inductor caches (36 s with the plain Inductor
    # variant, whose row runs the same loop as the others: --no-inductor leaves its compile
    # out and is itself checked); the timeout only guards against a hang.
    proc = run_demo("--quick", "--no-inductor", timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    # explain's report: the indexer's top-k was rewritten
    assert re.search(r"^hyscale: 1 top-k site\(s\): 1 fused, 0 selected from the table, 0 left alone", out, re.M), out[-4000:]
    assert re.search(r"^\s+\[rewritten\] topk at dsa_model\.py:\d+ in forward: ", out, re.M), out[-4000:]
    # the table, printed last: a header and one row per variant; hyscale equal to eager
    table = out[out.rindex("variant "):]
    assert re.match(r"variant\s+\| compile s \| forward ms \(median\) \| peak extra MiB \| equal to eager", table)
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in table.splitlines()[2:] if "|" in line}
    assert set(rows) == {"eager", "hyscale"}, table
    assert rows["eager"][4] == "(reference)", table
    assert rows["hyscale"][4].startswith("yes"), table
    for name, cells in rows.items():
        float(cells[2].replace(",", ""))  # forward ms is a number
        float(cells[3].replace(",", ""))  # peak extra MiB is a number
        if name != "eager":
            float(cells[1])  # compile s is a number


BAD_FLAGS = [
    (["--seq", "abc"], "--seq must be an integer"),
    (["--seq", "1"], "--seq must be at least 2"),
    (["--device", "tpu"], "--device must be one of auto, cpu, cuda"),
    (["--runs", "0"], "--runs must be at least 1"),
]


def test_demo_bad_flag_exits_2_naming_it():
    # as a user runs it: the exit status and the message on stderr
    flags, message = BAD_FLAGS[0]
    proc = run_demo(*flags, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_demo_bad_flags(flags, message, capsys):
    # the demo's own argument checks (argparse's error(): exit status 2, the message on
    # stderr), in this process: a fresh interpreter per flag only adds a torch import
    demo = _demo_module()
    with pytest.raises(SystemExit) as info:
        demo.parse_args(flags)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _demo_module():
    import importlib.util

    if "hyscale_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hyscale_demo", DEMO)
        module = sys.modules["hyscale_demo"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["hyscale_demo"]
            raise
    return sys.modules["hyscale_demo"]


@pytest.mark.inductor
def test_register_score_mod_example():
    """examples/register_score_mod.py: not fused before registering (selected from the
    materialized table), fused after,
    compiled outputs and gradients equal eager (one Inductor compile, ~15 s)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "register_score_mod.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    before, after = out.split("== after")
    assert "[rewritten: table]" in before and "register_score_mod" in before
    assert "[rewritten]" in after and "+softcap30" in after and "backward: sparse" in after
    assert re.search(r"vs eager: .*: equal$", out, re.M)
