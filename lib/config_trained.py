"""The trained models' part of the config tree (lib/config.py holds the root): the model folder, optimizer,
sharding, batching and update schedule the actor and the critic share, the actor's LoRA and policy loss, the
critic's value clip. Ground, like lib/config.py: it imports nothing of lib.
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
    liger: bool = False
    """GPU: Liger-Kernel's Triton kernels for RMSNorm, the SwiGLU MLP and the rotary embedding (lib/liger.py; pip
    install liger-kernel, in the gpu extra), for the architectures Liger lists. The plain path's numbers to bf16
    rounding. Refused on CPU."""
    compile_layers: bool = False
    """torch.compile each decoder layer's forward (regional compilation, lib/compiled.py): one graph shared by the
    layers, dynamic in the token count, at most 8 recompiles; the first update pays the compile (seconds to a minute).
    The same model to the compiler's floating-point reordering; its speed is a GPU figure (the acceptance run's
    update rows)."""
    fused_head: str = "auto"
    """on: make the response log-probs (and entropy) inside the LM head, a chunk of tokens at a time, its matmul
    redone per chunk in backward: no (tokens x vocabulary) logits tensor. off: the whole logits. auto: on on CPU,
    off on a GPU (the H100 measured the fused head at 0.97x the whole logits' tokens/s with a higher peak; bench/).
    Where it is on, the start-up self-check compares it with the whole logits on the model itself: a model that
    changes its logits after its head (Falcon-H1's muP multiplier) then runs the whole logits, said in one line
    (with on, the run is refused instead). Never for Gemma's softcap or Cohere's and Granite's scales (known)."""
    min_pixels: int = 0
    """Vision-language models: the fewest pixels an image is resized to (0: the model's image processor's own). The
    same for rollout and training."""
    max_pixels: int = 0
    """Vision-language models: the most pixels an image is resized to (0: the processor's own); bounds the image
    tokens per image (pixels / (patch x merge)^2)."""
    freeze_vision_tower: bool = False
    """Vision-language models trained with images: the vision tower (and its merger) stays as loaded."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Training steps (updates: one per RL step, whatever the mini-batches and epochs in it, as verl counts) of
    linear warm-up: update k (0-based) uses lr * (k + 1) / warmup_steps. 0: none."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or cosine-decay it to min_lr_ratio * lr at total_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    total_steps: int = 0
    """Training steps (updates) the cosine schedule spans. 0: the run's trainer steps."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. A non-finite norm skips the step (counted in metrics)."""
    step_without_gradient: bool = False
    """AdamW's step where the gradient is zero everywhere (no learning signal: every GRPO group scored alike, so every
    advantage is 0, and no KL or entropy term). False: that step is left out, the weights, AdamW's moments and its
    step count stay as they are (counted: ``<actor|critic>/zero_grad_steps``). AdamW would otherwise move the weights
    by its momentum alone and let its second moment decay, so that the next rare gradient (one sample wrong in a
    solved batch) meets a denominator far below its scale and moves every parameter it touches by ~3 lr, then more by
    momentum: a solved task unlearned (the default run continued to 3,000 steps collapsed at step ~1,620). True: step
    anyway (verl's trainer does)."""
    fused: bool = False
    """AdamW's fused kernel (one kernel a step for every parameter) instead of the multi-tensor one: the same update
    to the dtype's rounding (4e-9 apart on 6M parameters, CPU fp32). On CPU the optimizer step alone took 25.3 ->
    3.9 ms (6M parameters); the acceptance run's update check measures it on a GPU. Off by default: every learning
    test's trajectory would move with it, and no GPU figure says it pays there yet."""


@dataclass
class FSDPConfig:
    shard_size: int = 0
    """Ranks one copy of the model is sharded over. 0: all ranks (1-D FSDP); smaller: HSDP (replicate x shard);
    1: every rank holds the whole model (DDP-like: a plain replica, its gradients averaged by one all-reduce per
    optimizer step; with a bf16 compute cast on GPU, one FSDP unit at the root)."""
    mixed_precision: bool = True
    """GPU: bf16 compute, fp32 gradient reduction (params stay fp32). No effect on CPU (fp32)."""
    param_offload: bool = False
    """Move the sharded parameters to CPU while rolling out, back for training."""
    optimizer_offload: bool = False
    """Move the optimizer state to CPU outside the update."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (ZeRO-3). False keeps them (ZeRO-2, faster)."""
    grad_reduce: Literal["auto", "micro_batch", "step"] = "auto"
    """When gradients are reduced over the ranks. micro_batch: each micro-batch gathers every FSDP unit's parameters
    (forward, and again in backward; on GPU each gather casts the fp32 shards to bf16) and reduce-scatters its
    gradients. step: one gather and one reduction per optimizer step; every rank keeps the gathered parameters and
    its unsharded gradients (fp32) from one micro-batch to the next, and the last micro-batch's backward reduces and
    reshards. That costs the whole model's gathered parameters and gradients on every rank (6 bytes a parameter with
    bf16, 8 in fp32) on top of the shards: for a model that fits one device whole. auto: step where each rank holds
    the whole model already (shard_size 1 or one rank: FSDP's one root unit, which gathers the whole model anyway),
    micro_batch otherwise. The same update either way, up to the order of the gradient sum (fp32 rounding)."""


@dataclass
class BatchingConfig:
    micro_batch_size_per_rank: int = 4
    """Rows per forward/backward pass on one rank (ignored with dynamic batching)."""
    use_dynamic_batching: bool = False
    """Pack rows into micro-batches by token count (max_tokens_per_rank) instead of a fixed row count."""
    max_tokens_per_rank: int = 16384
    """Token budget of one dynamic micro-batch (prompt + response tokens); with token_budget memory, its cap."""
    token_budget: str = "fixed"
    """fixed: max_tokens_per_rank. memory (actor, dynamic batching, no sequence parallelism): sized once at start-up
    from the device's memory in bytes (its total less what is in use, AdamW's moments to come and a margin, over the
    activation bytes a token takes in a measured forward and backward: lib/budget.py), at most max_tokens_per_rank;
    printed. On CPU it is max_tokens_per_rank."""
    use_remove_padding: bool = True
    """Pack the valid tokens of a micro-batch into one row (no compute on padding)."""


@dataclass
class TrainedModelConfig:
    """What the actor and the critic share: a sharded model, its optimizer, batching and update schedule."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    mini_batch_size: int = 0
    """Samples (responses) per optimizer step, over all ranks. 0: the whole batch (one step per epoch)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)."""
    loss_scale_factor: float = 0.0
    """The constant seq-mean-token-sum-norm divides by (tokens). 0: rollout.max_response_length."""


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (lib/lora.py): the base frozen, the adapter trained and synced alone."""
    rank: int = 0
    """Adapter rank r. 0: no LoRA (full fine-tuning), unless adapter_path is set. RL learns even at rank 1
    ("LoRA Without Regret", 2025); use ~10x the full fine-tuning learning rate."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    target_modules: list[str] = field(default_factory=list)
    """Module names to adapt (e.g. q_proj v_proj). Empty: every linear layer of the decoder (not lm_head)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank)."""
    dropout: float = 0.0
    """Must be 0: with dropout the trainer's log-probs are not those of the policy that sampled."""
    adapter_path: str = ""
    """A PEFT adapter folder to start from (its adapter_config.json sets rank, alpha and targets). Empty: a fresh
    adapter (B = 0: the policy starts as the base)."""
    reference: str = "base"
    """The KL reference: base (the model with its adapter switched off; no second model) or init (the starting
    adapter of adapter_path, frozen, in a second model)."""
    merge: bool = False
    """Sync W + s*BA (merged in fp32 as a temporary) instead of the adapter: for an engine without LoRA. Every
    step then sends the whole model."""
    sleep_level: int = 1
    """Engine sleep between rollouts in adapter mode: 1 keeps the base (only the adapter is sent each step), 2
    frees it (the base is sent again every step)."""


@dataclass
class ActorConfig(TrainedModelConfig):
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: off)."""
    shuffle: bool = False
    """Shuffle rows into mini-batches each epoch (seeded by step and epoch)."""
    policy_loss: str = "vanilla"
    """A key of lib.algos.POLICY_LOSSES: vanilla (PPO clip, dual clip), gspo, cispo, gpg."""
    clip_ratio_low: float | None = None
    """Lower clip of the ratio. None: the policy loss's own default (0.2; gspo: 3e-4)."""
    clip_ratio_high: float | None = None
    """Upper clip; larger than clip_ratio_low is DAPO's clip-higher. None: the loss's default (0.2; gspo: 4e-4)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= coef * entropy). 0: entropy is only logged."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    """A key of lib.algos.KL_ESTIMATORS, optionally with '+' (k2 gradient)."""


@dataclass
class CriticConfig(TrainedModelConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    """Value clipping around the old values."""
