"""benchmarks/bench_attention_step.py's peak breakdown (``--mem-breakdown``) on a synthetic
allocator trace: the allocations live at the trace's peak, largest first, each named by
its first frame in hyscale / Inductor's code / transformers."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_attention_step as bench  # noqa: E402


def _ev(action, addr, size, fn="torch/_ops.py", line=1):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/x/torch/_ops.py", "line": 9, "name": "__call__"},
                       {"filename": fn, "line": line, "name": "f"}]}


def test_peak_breakdown_lists_what_is_live_at_the_peak():
    trace = [_ev("alloc", 1, 100, "/x/hyscale_compile/lowerings/attention_backward.py", 7),
             _ev("alloc", 2, 50, "/tmp/torchinductor_root/ab/cab.py", 3),
             _ev("free_requested", 2, 50), _ev("free_completed", 2, 50),
             _ev("alloc", 3, 70),  # peak: 1 and 3 live (170)
             _ev("free_requested", 1, 100),
             _ev("alloc", 4, 60)]  # 130: below the peak
    got = bench.peak_breakdown({"device_traces": [[], trace]}, top=5)
    assert got == [(100, "attention_backward.py:7 f"), (70, "_ops.py:9 __call__")]
    assert bench.peak_breakdown({"device_traces": [[]]}) == []
