import os
import sys

# the repository root on sys.path so tests can import tests.contract / tests.models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
