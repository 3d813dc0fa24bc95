"""Regional compilation: ``torch.compile`` of each decoder layer's forward (``actor.model.compile_layers``).

Compiling the layers, not the whole model (torchtitan's choice), keeps FSDP2's hooks, gradient checkpointing and the
fused LM head outside the compiled code: each layer's ``forward`` is replaced by its compiled self, the hooks run
around it as before. With nn.Module inlining (torch's default since 2.5) a layer's parameters are inputs of the
graph, not guards on it, so the layers of one class share one compiled graph instead of compiling once each.
``dynamic=True`` marks the token count dynamic from the first call: a run's micro-batches of changing lengths
reuse one graph rather than recompiling per shape, and dynamo's recompile limit (RECOMPILE_LIMIT, per code object)
bounds what is left (a new dtype or a 0/1-sized dimension); past it a layer runs eagerly, with torch's warning.

Numbers: the same model to inductor's reordering of floating-point sums (tests/test_compiled.py: log-probs and the
updated weights of a packed GRPO update against the eager layers). Ground: imports nothing of lib.
"""

from __future__ import annotations

from torch import nn

RECOMPILE_LIMIT = 8


def compile_layers(layers: list[nn.Module]) -> int:
    """Replace each layer's forward by ``torch.compile(forward, dynamic=True)``; returns the layers compiled."""
    import torch._dynamo  # here, not at the top: dynamo's import (~1 s of a core, inductor's too) only where it compiles

    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", RECOMPILE_LIMIT)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)
