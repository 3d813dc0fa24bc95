"""FSDP2 wrapping in one place: shard each decoder layer then the root, fill from rank 0, offload, full tensors.

- Mixed precision: bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU. Parameters (the
  optimizer's master copy) stay fp32 on every device.
- Mesh: the Topology's ``fsdp_mesh``; a 2-D (replicate, shard) mesh gives HSDP.
- Replica: when every rank holds the whole model (a shard group of one rank) and there is no dtype cast for
  FSDP to do, the model stays a plain module (no hooks, no DTensor dispatch) and ``average_gradients`` does the
  one thing FSDP would have done, a mean of the gradients over the ranks (one flat all-reduce per optimizer step).
- Init: every rank builds the model on the meta device; rank 0 alone reads the weights and
  ``set_model_state_dict(..., broadcast_from_rank0=True)`` scatters them into the shards. Buffers are not
  in the state dict when non-persistent (rotary ``inv_freq``), so they are broadcast one by one.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lib import liger, lora, models, ulysses
from lib.compiled import compile_layers
from lib.dist import Topology
from lib.models import hf_name, persistent_buffers, retie, tied_aliases
from lib.vision import BANNED_ATTR, is_vision_param, placeholder_ids


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the classes HF lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} lists no decoder layer class in _no_split_modules; "
                         f"FSDP2 would put the whole model in one unit")
    return layers


def apply_fsdp(model: nn.Module, topo: Topology, mixed_precision: bool = True, reshard_after_forward: bool = True,
               gradient_checkpointing: bool = False, grad_reduce: str = "micro_batch",
               mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head) on the fsdp mesh.

    When each rank holds the whole model (a shard group of one rank: fsdp.shard_size 1, or one rank), per-layer
    units free no memory and only add hooks and one gradient all-reduce per layer: the model stays a plain
    replica (module docstring), or, with a bf16 compute cast to do, the root is the one unit. Measured on the CPU
    default: step 0.212 s with per-layer units, 0.190 with the root unit, 0.156 as a plain replica, the same
    numbers throughout. ``mp_policy``: FSDP2's policy in place of ``compute_policy``'s (bench/bench_sync.py: the GPU's
    bf16 policy on a CPU, so that one rank's model is the root unit of DTensors a GPU syncs from)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = mp_policy or compute_policy(topo, mixed_precision)
    replicated = topo.fsdp_mesh.mesh.shape[-1] == 1
    if replicated and mp.param_dtype is None:
        setattr(model, REPLICA_FLAG, True)
        return model
    for layer in [] if replicated else decoder_layers(model):
        fully_shard(layer, mesh=topo.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=topo.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # fsdp.grad_reduce: "auto" defers where the one unit is the whole model (no memory beyond what it gathers anyway)
    if grad_reduce == "step" or (grad_reduce == "auto" and replicated and RESHARD_SETTER):
        setattr(model, DEFER_FLAG, reshard_after_forward)
    return model


REPLICA_FLAG = "_rl_plain_replica"
RESHARD_SETTER = hasattr(FSDPModule, "set_reshard_after_forward")
"""Whether this torch's FSDP can change reshard_after_forward at run time (torch >= 2.7), which a reduction once a
step needs (lib.preflight refuses fsdp.grad_reduce step without it; auto then reduces every micro-batch)."""
DEFER_FLAG = "_rl_defer_grad_reduce"
"""Set on an FSDP model whose gradients are reduced once per optimizer step (fsdp.grad_reduce); its value is the
model's own reshard_after_forward."""


def accumulating(model: nn.Module, micro_batches: list) -> Iterator:
    """The micro-batches of one optimizer step, one at a time. For a model built to reduce once a step and
    more than one micro-batch, FSDP is told before each forward: keep the parameters gathered after forward and
    backward, and keep the gradients unsharded (accumulated in the reduce dtype, fp32), except in the last
    micro-batch's backward, which reduces every gradient and reshards. So the step gathers (and casts) the
    parameters once and reduces once, whatever the number of micro-batches. The model's own settings come back
    when the step's micro-batches are done (or the loop is left)."""
    reshard_after_forward = getattr(model, DEFER_FLAG, None)
    if reshard_after_forward is None or len(micro_batches) < 2:
        yield from micro_batches
        return
    try:
        model.set_reshard_after_forward(False)
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            yield micro
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_reshard_after_forward(reshard_after_forward)


GPU_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def compute_policy(topo: Topology, mixed_precision: bool) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU (fsdp.mixed_precision), fp32 throughout on CPU."""
    if mixed_precision and topo.device.type == "cuda":
        return GPU_POLICY
    return MixedPrecisionPolicy()


@torch.no_grad()
def average_gradients(model: nn.Module) -> None:
    """A plain replica's gradients, averaged over all ranks (what FSDP's reduction does for a sharded model):
    one all-reduce of every gradient flattened together. A parameter without a gradient on this rank counts as
    zeros, so every rank sends the same layout. Nothing to do for FSDP models or a world of one."""
    if not getattr(model, REPLICA_FLAG, False) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


@torch.no_grad()
def load_from_rank0(model: nn.Module, full_model: nn.Module | None, topo: Topology) -> None:
    """Materialise the sharded meta ``model`` on the device and fill it from rank 0's ``full_model``
    (None on other ranks): parameters and persistent buffers through the state dict, every buffer by broadcast."""
    aliases = tied_aliases(model)
    model.to_empty(device=topo.device)
    # a plain replica's tied embeddings come back untied from to_empty (FSDP2 keeps its one sharded tensor):
    # tie them again, or lm_head and the embedding would train as two matrices
    retie(model, aliases)
    if topo.is_main and full_model is None:
        raise ValueError("rank 0 must pass the loaded model")
    full_sd = full_model.state_dict() if topo.is_main else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_buffers = dict(full_model.named_buffers()) if topo.is_main else {}
    for name, buf in model.named_buffers():
        if topo.is_main:
            buf.copy_(full_buffers[name].to(buf.device))
        # every rank needs rank 0's buffers (rotary caches are computed at init, which meta skipped)
        dist.broadcast(buf, src=0)


def set_trainable(model: nn.Module, trainable: bool) -> nn.Module:
    model.requires_grad_(trainable)
    return model.train(trainable)


# ---- fp32 forwards of a mixed-precision model (the start-up self-check)

FP32_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=None, output_dtype=None,
                                    cast_forward_inputs=True)


def param_groups(unit: nn.Module) -> list[Any]:
    """The parameter groups of one fully_shard unit: FSDP's private state, read in one place for the torch releases
    we claim. torch 2.13 keeps a list (``_fsdp_param_groups``, with the singular as a property); torch 2.11 (the GPU
    machine's) has only the singular ``_fsdp_param_group``, None for a unit without parameters of its own."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _fsdp_groups(model: nn.Module) -> list[tuple[Any, Any]]:
    """(FSDP state, its parameter group or None) of every fully_shard unit of ``model``."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return [(m._get_fsdp_state(), group) for m in units for group in (param_groups(m) or [None])]


def _drop_unsharded(model: nn.Module, groups: list[tuple[Any, Any]]) -> None:
    """Every unit resharded and its all-gather buffers and unsharded parameters forgotten: FSDP2 makes them once, in
    the dtype of the first all-gather, and reuses them after; a change of compute dtype needs them made again."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # the root keeps its parameters unsharded after a forward
    for _, group in groups:
        for param in group.fsdp_params if group is not None else []:
            param.all_gather_outputs = []
            if hasattr(param, "_unsharded_param"):
                del param._unsharded_param


@contextlib.contextmanager
def fp32_compute(model: nn.Module) -> Iterator[None]:
    """Forwards inside the block compute in fp32 on a model that FSDP2 runs in bf16 (mixed precision on GPU; a LoRA
    base stored in bf16 is cast up too): every unit all-gathers fp32 parameters. The start-up self-check runs in
    it, so its tolerance is fp32's on a GPU as on a CPU (in bf16 the packed and padded forwards differ by ~2e-2,
    and a leak across packed bounds of 1e-4 hides there). On the way out each unit's own policy is restored and its
    buffers are made again in the training dtype at the next forward. A model without mixed precision (CPU, a
    plain replica) is left as it is. FSDP2 offers no public switch of the compute dtype: this sets the policy that
    its lazy init reads and drops the buffers it keeps between all-gathers (the same attributes from torch 2.4 to
    2.13); tests/test_selfcheck.py checks it on gloo with bf16 mixed precision, and on a GPU (gpu-marked)."""
    # TF32 off as well: cuDNN's convolutions (LFM2's short convolutions) use it by default, and its 1e-3 rounding
    # would put the check back at half precision's blindness
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with _fp32_policy(model):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@contextlib.contextmanager
def _fp32_policy(model: nn.Module) -> Iterator[None]:
    groups = _fsdp_groups(model)
    if not any(state._mp_policy.param_dtype not in (None, torch.float32) for state, _ in groups):
        yield
        return
    saved = [(state._mp_policy, group.mp_policy if group is not None else None) for state, group in groups]

    def use(policies: list[tuple[Any, Any]]) -> None:
        _drop_unsharded(model, groups)
        for (state, group), (state_policy, group_policy) in zip(groups, policies):
            state._mp_policy = state_policy
            if group is not None:
                group.mp_policy = group_policy
                group._init_mp_dtypes()

    use([(FP32_COMPUTE, FP32_COMPUTE)] * len(groups))
    try:
        yield
    finally:
        use(saved)


# ---- offload between phases (rollout frees the training state, training brings it back)


@torch.no_grad()
def offload_model(model: nn.Module) -> None:
    model.to("cpu")  # FSDP2 re-registers its sharded parameters after .to()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def load_model(model: nn.Module, device: torch.device) -> None:
    model.to(device)


@torch.no_grad()
def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- full tensors, layer by layer, in HF names (weight sync and export)

def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) per parameter in registration order (embeddings, layer 0, layer 1, ...).
    Every rank must consume the iterator in step: each ``full_tensor()`` is an all-gather. The local shard is
    cast to ``dtype`` before the gather (a DTensor cast stays sharded), so an fp32 model synced into a bf16
    engine moves half the bytes; the result equals gathering then casting, bit for bit."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.detach()
            if dtype is not None:
                tensor = tensor.to(dtype)
            yield hf_name(name), tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_full_params_bucketed(model: nn.Module, dtype: torch.dtype | None, bucket_bytes: int,
                              cast_whole: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_full_params``'s tensors, bit for bit and in the same order, with one all-gather per bucket of at most
    ``bucket_bytes`` of full tensors instead of one per parameter (290 a sync for the 0.5B shape): each rank lays its
    dim-0 shards of the bucket's parameters side by side in one flat buffer of ``dtype`` (each padded to the largest
    rank's rows; the cast happens inside that copy, on the local shard, never through DTensor's dispatch), one
    ``all_gather_into_tensor`` over the shard group fills every rank's, and each full tensor is cut out of the ranks'
    blocks. A shard group of one rank holds whole tensors: each is yielded as its local tensor, cast where ``dtype``
    differs unless ``cast_whole`` is False (for a consumer whose copy casts: the weight sync), with no buffer and no
    collective. A parameter sharded another way (or not a DTensor) is gathered alone, in its place. Extra memory: a
    bucket's gathered buffer and its cut-out tensors. Every rank must consume it in step.

    Host work: no DTensor op a parameter. Under no_grad a parameter needs no ``detach()`` (nothing records autograd
    history), and a DTensor's ``detach()`` is one trip through its dispatch: about 47 us a parameter, 13.6 ms for
    the 0.5B's 290 on one GPU, where the root is one FSDP unit and every parameter a DTensor (issue 74). The local
    shards are read as they are (``_local``); a plain tensor is still detached (a plain op, ~1 us)."""
    pending: list[tuple[str, DTensor]] = []
    size = 0
    layouts: dict[tuple, tuple[int | None, bool]] = {}  # (mesh, placements) -> (shard mesh dim, one-rank group)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mesh_dim, whole = _layout(param, layouts)
            if whole:  # a shard group of one rank: the local shard is the whole tensor
                yield from _gather_bucket(pending, dtype)
                pending, size = [], 0
                local = _local(param)
                yield hf_name(name), local if not cast_whole or dtype in (None, local.dtype) else local.to(dtype)
                continue
            if mesh_dim is None:  # gathered alone (or whole already), after what is pending
                yield from _gather_bucket(pending, dtype)
                pending, size = [], 0
                tensor = param.detach()
                if dtype is not None:
                    tensor = tensor.to(dtype)
                yield hf_name(name), tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                continue
            nbytes = param.numel() * (dtype or param.dtype).itemsize
            if pending and (size + nbytes > bucket_bytes or param.device_mesh != pending[0][1].device_mesh
                            or (dtype is None and param.dtype != pending[0][1].dtype)):  # one buffer, one dtype
                yield from _gather_bucket(pending, dtype)
                pending, size = [], 0
            pending.append((name, param))
            size += nbytes
        yield from _gather_bucket(pending, dtype)


def _layout(tensor: torch.Tensor, seen: dict[tuple, tuple[int | None, bool]]) -> tuple[int | None, bool]:
    """(``_shard_dim``, whether that dimension's shard group is one rank) of a tensor, read once for each mesh and
    placements in ``seen`` (a walk's parameters share a few)."""
    if not isinstance(tensor, DTensor):
        return None, False
    key = (id(tensor.device_mesh), tensor.placements)
    hit = seen.get(key)
    if hit is None:
        mesh_dim = _shard_dim(tensor)
        hit = seen[key] = mesh_dim, mesh_dim is not None and tensor.device_mesh.size(mesh_dim) == 1
    return hit


def _local(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local shard as a plain tensor: what ``to_local()`` returns under no_grad (torch 2.4 to 2.11), read
    without it: from 2.13 it wraps a Parameter's shard in a fresh view flagged as a Parameter (gh-166156). FSDP2's
    shards never require grad (its DTensor does); another DTensor's may, and is then detached (a plain op)."""
    local = tensor._local_tensor
    return local.detach() if local.requires_grad else local


def _shard_dim(tensor: torch.Tensor) -> int | None:
    """The mesh dimension a DTensor is sharded over on its dim 0 (FSDP2's layout; replicated over any other mesh
    dimension, as HSDP's), or None for anything else."""
    if not isinstance(tensor, DTensor):
        return None
    placements = tensor.placements
    shards = [i for i, p in enumerate(placements) if p.is_shard()]
    if len(shards) != 1 or placements[shards[0]].dim != 0 or not all(p.is_replicate() for i, p in
                                                                     enumerate(placements) if i != shards[0]):
        return None
    return shards[0]


def _gather_bucket(pending: list[tuple[str, DTensor]], dtype: torch.dtype | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of a bucket of dim-0-sharded parameters over a shard group of more than one rank (one
    all-gather; ``iter_full_params_bucketed``)."""
    if not pending:
        return
    mesh_dim = _shard_dim(pending[0][1])
    group = pending[0][1].device_mesh.get_group(mesh_dim)
    world = dist.get_world_size(group)
    dtype = dtype or pending[0][1].dtype
    layout = []
    for name, tensor in pending:
        rows = tensor.shape[0]
        most = -(-rows // world)  # the first ranks' rows (torch.chunk's split, as FSDP2 shards)
        counts = [max(0, min(most, rows - r * most)) for r in range(world)]
        layout.append((name, tensor.shape, most, counts, most * tensor.shape[1:].numel()))
    # this rank's shards side by side, each at the start of its block (the rest of a block: zeros), one copy each
    # (casting to ``dtype`` as it copies)
    flat = torch.zeros(sum(numel for *_, numel in layout), dtype=dtype, device=pending[0][1].device)
    offset = 0
    for (_, tensor), (*_, numel) in zip(pending, layout):
        shard = _local(tensor).reshape(-1)
        flat[offset:offset + shard.numel()].copy_(shard)
        offset += numel
    # the shard group of the parameters' mesh: every rank's blocks, in rank order
    gathered = flat.new_empty(world * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    per_rank = gathered.view(world, flat.numel())
    offset = 0
    for name, shape, most, counts, numel in layout:
        blocks = per_rank[:, offset:offset + numel].reshape(world, most, *shape[1:])
        yield hf_name(name), torch.cat([blocks[r, :counts[r]] for r in range(world)])
        offset += numel


def iter_persistent_buffers(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor, floating ones cast to ``dtype``) of every persistent buffer (lib.models.persistent_buffers:
    the weights that are not parameters). FSDP2 keeps buffers whole on every rank, so no gather is needed."""
    for name, buf in persistent_buffers(model):
        tensor = buf.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield hf_name(name), tensor


def full_state_dict_on_rank0(model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
    """The full weights (parameters and persistent buffers) on CPU on rank 0 (empty elsewhere), one tensor
    gathered at a time."""
    out: dict[str, Any] = {}
    for name, tensor in itertools.chain(iter_full_params(model), iter_persistent_buffers(model)):
        if topo.is_main:
            out[name] = tensor.cpu()
        del tensor
    return out


FUSED_HEAD = ("auto", "on", "off")


def fused_head_wanted(setting: str, device: torch.device) -> bool:
    """model.fused_head: on, off, or auto (on on CPU, off on a GPU until a GPU window measures a gain there)."""
    return setting == "on" or (setting == "auto" and device.type != "cuda")


def build_sharded_model(model_cfg: Any, fsdp_cfg: Any, topo: Topology, kind: str = "causal_lm",
                        trainable: bool = True, packed: bool = True, lora_cfg: Any = None,
                        seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Meta-device model -> FSDP2 shards on the Topology's device, weights read on rank 0 only.
    ``packed``: the model will see packed rows (batching.use_remove_padding); with sp_size > 1 (Ulysses, head
    counts checked first) or on GPU such a model attends through lib/attention.py's varlen path.
    ``lora_cfg`` (actor.lora, when enabled): LoRA layers are injected before sharding; only the adapter trains, the
    frozen base is bf16 on GPU, a fresh adapter's init is seeded by ``seed``, and a trained model's ``base_hash``
    holds lib.lora.base_hash of the base weights (on every rank; checkpoints carry it). ``mp_policy``: apply_fsdp's."""
    config, dropout_off = models.without_dropout(models.load_config(model_cfg.path, model_cfg.trust_remote_code))
    attn = models.attn_implementation(model_cfg.attn_implementation, packed, topo.sp_size, config)
    if topo.sp_size > 1:
        text = config.get_text_config()  # a vision-language checkpoint trains its language model
        ulysses.check_heads(text.num_attention_heads, getattr(text, "num_key_value_heads", None)
                            or text.num_attention_heads, topo.sp_size)
    model = models.build_empty(config, kind, attn, model_cfg.trust_remote_code)
    pc = lora.peft_config(lora_cfg) if lora_cfg is not None and lora.enabled(lora_cfg) else None
    frozen_dtype = (mp_policy or compute_policy(topo, fsdp_cfg.mixed_precision)).param_dtype  # the frozen base's
    if pc is not None:
        lora.inject(model, pc)
        if frozen_dtype is not None:
            lora.cast_frozen(model, frozen_dtype)
    if model_cfg.liger:
        liger.apply(model)  # before compiling and sharding: its kernels replace the layers' own parts
    if model_cfg.compile_layers:
        compile_layers(decoder_layers(model))  # before sharding: FSDP's hooks stay outside the compiled code
    apply_fsdp(model, topo, fsdp_cfg.mixed_precision, fsdp_cfg.reshard_after_forward,
               model_cfg.gradient_checkpointing and trainable, fsdp_cfg.grad_reduce if trainable else "micro_batch",
               mp_policy)
    full = models.load_full(model_cfg.path, kind, attn, model_cfg.trust_remote_code, config) if topo.is_main else None
    digest = [None]
    if pc is not None and topo.is_main:
        if trainable:  # a frozen reference is never checkpointed
            digest[0] = lora.base_hash(iter_full_params(full))
        with torch.random.fork_rng():  # the adapter's init is seeded apart from every other generator
            torch.manual_seed(seed)
            lora.inject(full, pc)
        if lora_cfg.adapter_path:
            lora.load_adapter_weights(full, lora_cfg.adapter_path)
        if frozen_dtype is not None:
            lora.cast_frozen(full, frozen_dtype)  # the broadcast fills bf16 shards from bf16 tensors
    load_from_rank0(model, full, topo)
    del full
    models.check_not_meta(model)
    model.dropout_off = dropout_off  # the settings turned off, for the start-up log
    if not fused_head_wanted(model_cfg.fused_head, topo.device):
        setattr(model, models.UNFUSED_HEAD_ATTR, True)
    if kind == "vision_lm":
        setattr(model, BANNED_ATTR, placeholder_ids(config))
    if pc is None:
        set_trainable(model, trainable)
        if kind == "vision_lm" and model_cfg.freeze_vision_tower:
            for name, param in model.named_parameters():
                param.requires_grad_(param.requires_grad and not is_vision_param(name))
        return model
    if trainable:
        dist.broadcast_object_list(digest, src=0)  # world: every rank checks a resume against the same base
        model.base_hash = digest[0]
    model.train(trainable)
    for name, param in model.named_parameters():
        param.requires_grad_(trainable and lora.is_adapter_param(name))
    return model
