"""Installs lib.fake_device in a child process (torchrun's launcher and ranks) whose environment sets RL_FAKE_CUDA=1;
tests put this folder and the repository's root on the child's PYTHONPATH (tests/helpers.py fake_cuda_env)."""

import os

if os.environ.get("RL_FAKE_CUDA") == "1":
    from lib import fake_device

    fake_device.install()
