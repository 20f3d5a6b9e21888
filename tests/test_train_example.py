"""Short run of ``examples/train_dsa.py`` (the DSA indexer recipe: dense model, dense warm-up of the
indexer with its KL loss, sparse training, control), run as a user runs it, with the debug backend
(same passes, no Inductor codegen) to keep it fast."""
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_dsa.py")


def test_train_dsa_indexer_learns(tmp_path):
    png = tmp_path / "loss.png"
    # S = 64, k = 4: the dense model learns the lookup in ~200 steps, and the warm-up then teaches
    # the indexer where the answers are. About 60 s on 2 idle CPU cores (explain, debug-backend
    # compiles, ~250 small steps); the timeout only guards against a hang.
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--seq", "64", "--dense-steps", "300", "--warmup-steps", "40", "--steps", "4",
         "--compare-steps", "2", "--backend", "hyscale_debug", "--out", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"train_dsa exited {proc.returncode}\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    # explain: both layers' indexer top-k rewritten on the sparse stage's training graph
    assert re.search(r"^hyscale: 2 top-k site\(s\): 2 fused, 0 selected from the table, 0 left alone", out, re.M), out[-4000:]
    # the sparse stage under hyscale_debug matched the reference backend step for step
    assert re.search(r"^step-for-step check: PASSED: answer loss hyscale_debug vs aot_eager within 2% at all of the "
                     r"first 2 step\(s\)", out, re.M), out[-4000:]
    # the warm-up's KL fell, and the indexer's recall of the answer rose well above the random baseline
    m = re.search(r"^  warm-up KL (\S+) -> (\S+); recall@k per layer (\S+) / (\S+) \(indexer at init\) -> "
                  r"(\S+) / (\S+) \(baseline (\S+)\)", out, re.M)
    assert m, out[-4000:]
    kl0, kl1, r0a, r0b, r1a, r1b, base = map(float, m.groups())
    assert kl1 < 0.7 * kl0, out[-4000:]
    assert max(r1a, r1b) > 2 * base and max(r1a, r1b) > max(r0a, r0b) + 0.05, out[-4000:]
    m = re.search(r"^final answer loss (\S+), final indexer KL (\S+)", out, re.M)
    assert m and math.isfinite(float(m.group(1))) and math.isfinite(float(m.group(2))), out[-4000:]
    assert re.search(r"^final answer accuracy \d\.\d+ ", out, re.M), out[-4000:]
    assert re.search(r"^control \(indexer frozen at init\): accuracy \d\.\d+ ", out, re.M), out[-4000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert png.is_file() and png.stat().st_size > 0
