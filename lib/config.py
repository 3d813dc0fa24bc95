"""The config tree: one set of dataclasses, every field documented with units and sentinels.

(The tyro command line, YAML presets and the pre-flight validation of the whole run arrive with the
training scripts; the training-engine parts are defined here so that lib/ never reads loose dicts.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model folder (config.json + weights)."""
    trust_remote_code: bool = False
    """Run the model's own Python code from its folder. Off unless you trust the source."""
    attn_implementation: str = "auto"
    """auto: flash_attention_2 on GPU when installed, else sdpa. Or any transformers attention name."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr. 0: none."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or cosine-decay it to min_lr_ratio * lr at total_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    total_steps: int = 0
    """Optimizer steps the cosine schedule spans (set from the run length). 0: constant after warm-up."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. A non-finite norm skips the step (counted in metrics)."""


@dataclass
class FSDPConfig:
    shard_size: int = 0
    """Ranks one copy of the model is sharded over. 0: all ranks (1-D FSDP); smaller: HSDP (replicate x shard)."""
    mixed_precision: bool = True
    """GPU: bf16 compute, fp32 gradient reduction (params stay fp32). No effect on CPU (fp32)."""
    param_offload: bool = False
    """Move the sharded parameters to CPU while rolling out, back for training."""
    optimizer_offload: bool = False
    """Move the optimizer state to CPU outside the update."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (ZeRO-3). False keeps them (ZeRO-2, faster)."""


@dataclass
class BatchingConfig:
    micro_batch_size_per_rank: int = 4
    """Rows per forward/backward pass on one rank (ignored with dynamic batching)."""
    use_dynamic_batching: bool = False
    """Pack rows into micro-batches by token count (max_tokens_per_rank) instead of a fixed row count."""
    max_tokens_per_rank: int = 16384
    """Token budget of one dynamic micro-batch (prompt + response tokens)."""
    use_remove_padding: bool = True
    """Pack the valid tokens of a micro-batch into one row (no compute on padding)."""


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    mini_batch_size: int = 0
    """Samples (responses) per optimizer step, over all ranks. 0: the whole batch (one step per epoch)."""
    shuffle: bool = False
    """Shuffle rows into mini-batches each epoch (seeded by step and epoch)."""
    policy_loss: str = "vanilla"
    """A key of lib.algos.POLICY_LOSSES: vanilla (PPO clip, dual clip), gspo, cispo, gpg."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """Upper clip; larger than clip_ratio_low is DAPO's clip-higher."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= coef * entropy). 0: entropy is only logged."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    """A key of lib.algos.KL_ESTIMATORS, optionally with '+' (k2 gradient)."""


@dataclass
class CriticConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    ppo_epochs: int = 1
    mini_batch_size: int = 0
    """Samples per critic optimizer step, over all ranks. 0: the whole batch."""
    cliprange_value: float = 0.5
    """Value clipping around the old values."""
    loss_agg_mode: str = "token-mean"
