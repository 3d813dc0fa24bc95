"""Token log-probs and entropy from logits without a full-size float32 log-softmax.

At V = 151936 and T = 4096 a float32 (T, V) tensor is 2.5 GB; the naive
``log_softmax(logits.float(), -1).gather(...)`` makes two of them (the cast and the result), and autograd
keeps them. Here tokens are processed in chunks: forward keeps only (N,) statistics, backward recomputes
each chunk's softmax and writes the gradient in the logits' dtype. ``log_probs_naive`` is the plain
reference that the tests and bench/bench_algos.py compare against.

``head_log_probs`` goes one step further (the forwards' default, lib.forward): it takes the LM head's input and
weight, makes each chunk's logits, uses them and drops them, in forward and again in backward, so the (T, V) logits
tensor and its gradient never exist (at T = 32768 in bf16: 2 x 10 GB); the price is the head's matmul once more.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """float32 logits / temperature, never writing into the caller's tensor."""
    if chunk.dtype == torch.float32:
        return chunk / temperature if temperature != 1.0 else chunk
    z = chunk.float()  # a fresh copy: dividing in place is safe
    return z.div_(temperature) if temperature != 1.0 else z


def _log_softmax(chunk: Tensor, temperature: float) -> Tensor:
    """float32 log_softmax(chunk / temperature); at temperature 1 the cast is fused into the kernel."""
    if temperature == 1.0:
        return torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
    return torch.log_softmax(_scaled(chunk, temperature), dim=-1)


def _softmax(chunk: Tensor, temperature: float) -> Tensor:
    if temperature == 1.0:
        return torch.softmax(chunk, dim=-1, dtype=torch.float32)
    return torch.softmax(_scaled(chunk, temperature), dim=-1)


def default_chunk_tokens(vocab: int, device: torch.device, fused: bool = False) -> int:
    """Tokens per chunk: ~0.3 GB of float32 logits on GPU (large kernels), ~16 MB on CPU, where the allocator
    returns big blocks to the OS and every fresh one costs page faults (measured: 2x slower at 512 tokens). The fused
    head reads its whole weight for every chunk, four times: ~256 MB on CPU (measured at 1024 tokens, vocab 32768,
    hidden 256, with other work on the 2 cores: 16 MB chunks took 3.1x the unfused time, 256 MB ones 1.06x)."""
    if device.type == "cuda":
        budget = 512 * 151936 * 4
    else:
        budget = 256 * 2**20 if fused else 16 * 2**20
    return max(1, budget // (4 * vocab))


def _chunk_forward(z: Tensor, labels: Tensor, temperature: float, with_entropy: bool
                   ) -> tuple[Tensor, Tensor | None]:
    """One chunk's log p(labels) (c, m) and entropy (c,) (None unless asked), float32, from its logits z (c, V)."""
    lsm = _log_softmax(z, temperature)  # one fused pass
    # H = -sum(p * log p), from log p directly (lse - E_p[z] cancels badly when both are large)
    return lsm.gather(-1, labels), (-torch.linalg.vecdot(lsm.exp(), lsm) if with_entropy else None)


def _chunk_grad(z: Tensor, labels: Tensor, grad_logp: Tensor, grad_entropy: Tensor | None, entropy: Tensor,
                temperature: float) -> Tensor:
    """d loss / d z (c, V) float32 of one chunk, from the gradients of its log-probs (c, m) and, where the loss uses
    it, of its entropy (c,)."""
    # d/dlogits = d/dz / t: fold 1/t into the incoming gradients instead of a pass over the chunk
    gl = grad_logp.float() / temperature  # (c, m)
    total = gl.sum(-1, keepdim=True)
    if grad_entropy is not None:
        # d logp_label/dz = onehot - p ; dH/dz = -p * (log p + H)
        # => g = p * (-sum(gl) - ge * (log p + H)) + sum of onehot * gl, built in place in log p's memory
        lsm = _log_softmax(z, temperature)
        p = lsm.exp()
        ge = grad_entropy[:, None].float() / temperature
        g = lsm.add_(entropy[:, None]).mul_(-ge).sub_(total).mul_(p)
        del p, lsm
    else:
        g = _softmax(z, temperature).mul_(-total)  # (onehot - p) * gl, the onehot parts below
    return g.scatter_add_(-1, labels, gl)


def _outputs(n: int, labels: Tensor, with_entropy: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    entropy = torch.empty(n, dtype=torch.float32, device=device) if with_entropy else torch.zeros(0, device=device)
    return torch.empty(labels.shape, dtype=torch.float32, device=device), entropy


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk: int):
        # logits: (N, V) any float dtype; labels: (N, m) long, m labels per position
        logp, entropy = _outputs(logits.shape[0], labels, with_entropy, logits.device)
        for s in range(0, logits.shape[0], chunk):
            lp, ent = _chunk_forward(logits[s:s + chunk], labels[s:s + chunk], temperature, with_entropy)
            logp[s:s + chunk] = lp
            if with_entropy:
                entropy[s:s + chunk] = ent
        ctx.save_for_backward(logits, labels, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        # an output the loss does not use (the entropy at entropy_coef 0, logged only) comes to backward as None,
        # not as zeros that would cost the entropy's gradient pass over every chunk
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        logits, labels, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad_logp, grad_entropy = _incoming(grad_logp, grad_entropy, labels, ctx.with_entropy)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            grad[s:e] = _chunk_grad(logits[s:e], labels[s:e], grad_logp[s:e],
                                    None if grad_entropy is None else grad_entropy[s:e], entropy[s:e],
                                    ctx.temperature)
        return grad, None, None, None, None


def _incoming(grad_logp: Tensor | None, grad_entropy: Tensor | None, labels: Tensor, with_entropy: bool
              ) -> tuple[Tensor, Tensor | None]:
    """The gradients backward gets, with None for an output the loss leaves out: zeros for the log-probs (only the
    entropy in the loss), None for the entropy (its gradient pass is skipped)."""
    if grad_logp is None:
        grad_logp = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    return grad_logp, (grad_entropy if with_entropy else None)


def _head_chunk(hidden: Tensor, weight: Tensor, banned: Tensor | None, ban_value: float) -> Tensor:
    """One chunk's logits (c, V), in the hidden states' dtype as the LM head makes them, ``banned`` columns set."""
    z = torch.nn.functional.linear(hidden, weight)
    return z if banned is None else z.index_fill_(-1, banned, ban_value)


class _FusedHeadLogProbs(torch.autograd.Function):
    """The LM head's matmul and the chunked log-prob in one: each chunk's logits are made from its hidden states,
    used and dropped, in forward and again in backward; no (N, V) tensor exists at any time."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, with_entropy: bool,
                chunk: int, banned: Tensor | None, ban_value: float):
        # hidden: (N, H); weight: (V, H), the head's; labels: (N, m)
        logp, entropy = _outputs(hidden.shape[0], labels, with_entropy, hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            z = _head_chunk(hidden[s:s + chunk], weight, banned, ban_value)
            lp, ent = _chunk_forward(z, labels[s:s + chunk], temperature, with_entropy)
            logp[s:s + chunk] = lp
            if with_entropy:
                entropy[s:s + chunk] = ent
            del z
        ctx.save_for_backward(hidden, weight, labels, entropy, banned)
        ctx.temperature, ctx.with_entropy, ctx.chunk, ctx.ban_value = temperature, with_entropy, chunk, ban_value
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        hidden, weight, labels, entropy, banned = ctx.saved_tensors
        grad_logp, grad_entropy = _incoming(grad_logp, grad_entropy, labels, ctx.with_entropy)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # the weight's gradient sums over every chunk: in float32 at least, cast once at the end
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = s + ctx.chunk
            z = _head_chunk(hidden[s:e], weight, banned, ctx.ban_value)
            g = _chunk_grad(z, labels[s:e], grad_logp[s:e], None if grad_entropy is None else grad_entropy[s:e],
                            entropy[s:e], ctx.temperature)
            del z
            if banned is not None:  # the filled columns take no gradient (as index_fill's backward gives them)
                g.index_fill_(-1, banned, 0.0)
            g = g.to(hidden.dtype)  # the logits' gradient in their dtype, as the head's backward gets it
            if grad_hidden is not None:
                grad_hidden[s:e] = g @ weight
            if grad_weight is not None:
                if g.dtype == acc:  # in place: no (V, H) temporary per chunk
                    grad_weight.addmm_(g.t(), hidden[s:e])
                else:  # a bf16 product (half the weight's float32 size), summed in float32
                    grad_weight += (g.t() @ hidden[s:e]).to(acc)
            del g
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


def head_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, banned: Tensor | None = None, ban_value: float = 0.0,
                   chunk_tokens: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``log_probs_from_logits(hidden @ weight.T, ...)`` (the ``banned`` columns of the logits set to ``ban_value``)
    without making the logits: the LM head fused with the chunked log-prob (and entropy), its matmul redone per chunk
    in backward. hidden (N, H); weight (V, H); labels (N,) or (N, m). Differentiable in hidden and weight."""
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], hidden.device, fused=True)
    flat_labels = labels if labels.dim() == 2 else labels[:, None]
    logp, entropy = _FusedHeadLogProbs.apply(hidden, weight, flat_labels, float(temperature), with_entropy, chunk,
                                             banned, float(ban_value))
    return logp.view(labels.shape), (entropy if with_entropy else None)


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                          chunk_tokens: int | None = None) -> tuple[Tensor, Tensor | None]:
    """log p(label) under softmax(logits / temperature), and the entropy if asked; float32, shape of labels.

    logits: (..., V); labels: (...) long, or (..., m): m labels at each position (the entropy is then (...)).
    Differentiable in logits (both outputs)."""
    shape, lead = labels.shape, logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_tokens or default_chunk_tokens(flat_logits.shape[-1], flat_logits.device)
    flat_labels = labels.reshape(-1, labels.shape[-1] if labels.dim() == logits.dim() else 1)
    logp, entropy = _ChunkedLogProbs.apply(flat_logits, flat_labels, float(temperature), with_entropy, chunk)
    return logp.view(shape), (entropy.view(lead) if with_entropy else None)


@torch.no_grad()
def top_log_probs(logits: Tensor, k: int, temperature: float = 1.0, chunk_tokens: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """The k most likely tokens under softmax(logits / temperature) at each position: log-probs (..., k + 1) float32,
    the k highest first, then all the other tokens' together (logsumexp, -inf at k = V); and the k ids (..., k).
    No grad."""
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_tokens or default_chunk_tokens(flat.shape[-1], flat.device)
    values = torch.empty((flat.shape[0], k + 1), dtype=torch.float32, device=flat.device)
    ids = torch.empty((flat.shape[0], k), dtype=torch.long, device=flat.device)
    for s in range(0, flat.shape[0], chunk):
        lsm = _log_softmax(flat[s:s + chunk], temperature)
        values[s:s + chunk, :k], ids[s:s + chunk] = lsm.topk(k, dim=-1)
        values[s:s + chunk, k] = lsm.scatter_(-1, ids[s:s + chunk], float("-inf")).logsumexp(-1)
        del lsm
    return values.view(*logits.shape[:-1], k + 1), ids.view(*logits.shape[:-1], k)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, float32; no grad (for metrics)."""
    with torch.no_grad():
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return log_probs_from_logits(logits, labels, temperature, with_entropy=True)[1]


def log_probs_naive(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The plain reference: a full float32 log-softmax. (log-probs, entropy)"""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
