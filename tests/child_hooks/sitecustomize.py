"""Test hooks installed at interpreter start in child processes (torchrun's launcher and ranks) that have this folder
and the repository's root on their PYTHONPATH (tests/helpers.py child_env):

- RL_FAKE_CUDA=1: lib.fake_device, the CUDA API our code reads faked on CPU;
- RL_BLIND_MIXERS=1: lib.mixers.bound does nothing, so a model with a linear-attention or convolution layer leaks
  across packed sequences as an architecture the mixers do not know would (the start-up self-check must refuse it);
- RL_ENGINE_ROUTER_BIAS=x: after every weight sync, the HF engine's MoE routers' correction bias is moved by x times a
  fixed random draw: the engine's copy chooses other experts than the trainer's would, with the same gate weights
  (DeepSeek-V3 and GLM-4.5 choose by the bias and weigh without it);
- RL_VLLM_CUDA_LAYOUT=1: vLLM's CPU build keeps weights as its CUDA build does (lib.engine.vllm_cuda_layout), so the
  weight sync takes the GPU's path.
"""

import os

if os.environ.get("RL_FAKE_CUDA") == "1":
    from lib import fake_device

    fake_device.install()

if os.environ.get("RL_BLIND_MIXERS") == "1":
    from lib import mixers

    mixers.bound = lambda model: []

if os.environ.get("RL_ENGINE_ROUTER_BIAS"):
    import torch

    from lib import routing
    from lib.engine.hf import HFEngine

    scale = float(os.environ["RL_ENGINE_ROUTER_BIAS"])
    synced = HFEngine.finish_sync

    def finish_sync(self):
        synced(self)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for router in routing.routers(self.model):
                bias = router.e_score_correction_bias
                bias.add_(scale * torch.randn(bias.shape, generator=g).to(bias))

    HFEngine.finish_sync = finish_sync

if os.environ.get("RL_VLLM_CUDA_LAYOUT") == "1":
    # vLLM's CPU build keeping weights as its CUDA build does (lib/engine/vllm_cuda_layout.py), installed just before
    # an engine is built: vLLM is imported only by a process that builds one
    from lib.engine import vllm as engine_vllm

    built = engine_vllm.VLLMEngine.__init__

    def __init__(self, *args, **kwargs):
        from lib.engine import vllm_cuda_layout

        vllm_cuda_layout.install()
        built(self, *args, **kwargs)

    engine_vllm.VLLMEngine.__init__ = __init__
