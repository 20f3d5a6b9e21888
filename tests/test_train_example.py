"""Smoke test of ``examples/train_dsa.py`` (selection replay under activation checkpointing),
run as a user runs it, with the debug backend (same passes, no Inductor codegen) to keep it fast."""
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_dsa.py")


def test_train_dsa_smoke(tmp_path):
    png = tmp_path / "loss.png"
    # About 15 s on 2 idle CPU cores (explain + two debug-backend compiles + 3 steps); the
    # timeout only guards against a hang.
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--steps", "3", "--compare-steps", "2", "--backend", "hyscale_debug",
         "--out", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"train_dsa exited {proc.returncode}\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    # explain: both layers' indexer top-k rewritten on the training (grad-enabled) graph
    assert re.search(r"^hyscale: 2 top-k site\(s\): 2 fused, 0 selected from the table, 0 left alone", out, re.M), out[-4000:]
    # the step-for-step check against the reference backend passed, on both steps
    assert re.search(r"^step-for-step check: PASSED: hyscale_debug loss matches aot_eager at all 2 step\(s\)",
                     out, re.M), out[-4000:]
    assert len(re.findall(r"^\s+step \d: loss aot_eager \S+\s+hyscale_debug \S+\s+\|diff\| \S+ \(tol \S+\) ok", out, re.M)) == 2
    m = re.search(r"^final loss (\S+) ", out, re.M)
    assert m and math.isfinite(float(m.group(1))), out[-4000:]
    assert re.search(r"^final answer accuracy \d\.\d+ ", out, re.M), out[-4000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert png.is_file() and png.stat().st_size > 0
