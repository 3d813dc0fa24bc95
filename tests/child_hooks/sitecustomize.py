"""Test hooks installed at interpreter start in child processes (torchrun's launcher and ranks) that have this folder
and the repository's root on their PYTHONPATH (tests/helpers.py child_env):

- RL_FAKE_CUDA=1: lib.fake_device, the CUDA API our code reads faked on CPU;
- RL_BLIND_MIXERS=1: lib.mixers.bound does nothing, so a model with a linear-attention or convolution layer leaks
  across packed sequences as an architecture the mixers do not know would (the start-up self-check must refuse it).
"""

import os

if os.environ.get("RL_FAKE_CUDA") == "1":
    from lib import fake_device

    fake_device.install()

if os.environ.get("RL_BLIND_MIXERS") == "1":
    from lib import mixers

    mixers.bound = lambda model: []
