"""actor.model.liger: Liger-Kernel's Triton kernels (the ``liger-kernel`` package, 0.8.5, in the ``gpu`` extra) for the
elementwise parts of the trained model's decoder layers, through its own ``apply_liger_kernel_to_<model type>``:

- RMSNorm: the norms' forward and backward in one kernel each (``LigerRMSNorm``) instead of PyTorch's pow, mean,
  rsqrt and multiplies;
- the SwiGLU MLP's ``silu(gate) * up`` in one kernel (``LigerSwiGLUMLP``, its backward recomputing the product);
- the rotary embedding's ``apply_rotary_pos_emb`` in one kernel for q and k.

Not its fused linear cross-entropy nor its cross-entropy: the LM head makes the log-probs itself (lib/forward.py).
Liger patches the model instance and, for the classes and functions it replaces, transformers' modeling module of
that architecture: every model of that type built afterwards in the process (the reference, the HF engine's replica)
uses the same kernels. Triton kernels: a GPU only; the architectures are Liger's list (MODEL_TYPE_TO_APPLY_LIGER_FN).
The numbers are the plain path's to bf16 rounding (tests/test_gpu_engine.py, run by the GPU acceptance session).
"""

from __future__ import annotations

import importlib.util
import inspect

from torch import nn

VERSION = "0.8.5"
KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


def unusable(model_type: str, cuda: bool) -> str:
    """Why actor.model.liger cannot run here ("" if it can): checked before any model loads (``model_type`` ""
    where the model's config is not read: its architecture unchecked)."""
    if not cuda:
        return "actor.model.liger needs a GPU (Liger's kernels are Triton kernels); leave it off on CPU"
    if importlib.util.find_spec("liger_kernel") is None:
        return f"actor.model.liger needs the liger-kernel package: pip install liger-kernel=={VERSION} (or '.[gpu]')"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type and model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (f"actor.model.liger: Liger has no kernels for model type {model_type!r} (it has "
                f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); leave it off")
    return ""


def apply(model: nn.Module) -> list[str]:
    """Liger's kernels on ``model`` (before sharding); returns the kernels applied."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type]
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in KERNELS.items() if k in accepted}
    fn(model=model, **kwargs)
    return sorted(k for k, v in kwargs.items() if v)
