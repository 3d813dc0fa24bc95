"""Packed attention (lib/attention.py): the same numbers as padded sdpa, gradient checkpointing included.

On CPU the per-sequence sdpa kernel runs; on a GPU (marked) torch's varlen flash kernel in bf16."""

import pytest
import torch

from lib import attention
from lib.forward import response_log_probs
from tests.helpers import rl_batch, tiny_config


def _pair(device, dtype, checkpointing):
    """The same weights twice: one model on transformers' sdpa (padded rows), one on our packed attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa", dtype=dtype)
    packed = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation=attention.register(),
                                              dtype=dtype)
    packed.load_state_dict(plain.state_dict())
    if checkpointing:
        packed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return plain.to(device).train(), packed.to(device).train()


def _compare(device, dtype, checkpointing):
    plain, packed = _pair(device, dtype, checkpointing)
    data = rl_batch(6, prompt_len=7, response_len=5, seed=4, min_response=1).to(device)
    mask = data.batch["response_mask"]
    ref, _ = response_log_probs(plain, data, packed=False)
    out, _ = response_log_probs(packed, data, packed=True)
    (ref * mask).sum().backward()
    (out * mask).sum().backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    grad_diff = max(float((p.grad - grads[n]).abs().max()) for n, p in packed.named_parameters())
    return float(((out - ref) * mask).detach().abs().max()), grad_diff


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_attention_matches_padded_sdpa(checkpointing):
    logp_diff, grad_diff = _compare("cpu", torch.float32, checkpointing)
    assert logp_diff < 1e-5 and grad_diff < 1e-5, (logp_diff, grad_diff)


def test_packed_model_refuses_a_padded_call():
    _, packed = _pair("cpu", torch.float32, False)
    data = rl_batch(2, seed=1)
    with pytest.raises(RuntimeError, match="takes packed rows only"):
        response_log_probs(packed, data, packed=False)


@pytest.mark.gpu
def test_varlen_kernel_on_gpu_matches_padded_sdpa():
    assert attention.varlen_kernel() is not None, "torch >= 2.10 has varlen_attn"
    logp_diff, grad_diff = _compare("cuda", torch.bfloat16, True)
    # bf16: both sides round the same weights, but the kernels sum in different orders
    assert logp_diff < 5e-2 and grad_diff < 5e-1, (logp_diff, grad_diff)
