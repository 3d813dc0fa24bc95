"""Token log-probs and entropy from logits without a full-size float32 log-softmax.

At V = 151936 and T = 4096 a float32 (T, V) tensor is 2.5 GB; the naive
``log_softmax(logits.float(), -1).gather(...)`` makes two of them (the cast and the result), and autograd
keeps them. Here tokens are processed in chunks: forward keeps only (N,) statistics, backward recomputes
each chunk's softmax and writes the gradient in the logits' dtype. ``log_probs_naive`` is the plain
reference that the tests and bench/bench_algos.py compare against.
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


def default_chunk_tokens(logits: Tensor) -> int:
    """Tokens per chunk: ~0.3 GB of float32 logits on GPU (large kernels), ~16 MB on CPU, where the allocator
    returns big blocks to the OS and every fresh one costs page faults (measured: 2x slower at 512 tokens)."""
    budget = 512 * 151936 * 4 if logits.device.type == "cuda" else 16 * 2**20
    return max(1, budget // (4 * logits.shape[-1]))


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk: int):
        # logits: (N, V) any float dtype; labels: (N, m) long, m labels per position
        n = logits.shape[0]
        logp = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else \
            torch.zeros(0, device=logits.device)
        for s in range(0, n, chunk):
            lsm = _log_softmax(logits[s:s + chunk], temperature)  # one fused pass
            logp[s:s + chunk] = lsm.gather(-1, labels[s:s + chunk])
            if with_entropy:
                # H = -sum(p * log p), from log p directly (lse - E_p[z] cancels badly when both are large)
                entropy[s:s + chunk] = -torch.linalg.vecdot(lsm.exp(), lsm)
            del lsm
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
        t = ctx.temperature
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logp is None:  # only the entropy is in the loss
            grad_logp = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            # d/dlogits = d/dz / t: fold 1/t into the incoming gradients instead of a pass over the chunk
            gl = grad_logp[s:e].float() / t  # (n, m)
            total = gl.sum(-1, keepdim=True)
            if use_entropy:
                # d logp_label/dz = onehot - p ; dH/dz = -p * (log p + H)
                # => g = p * (-sum(gl) - ge * (log p + H)) + sum of onehot * gl, built in place in log p's memory
                lsm = _log_softmax(logits[s:e], t)
                p = lsm.exp()
                ge = grad_entropy[s:e, None].float() / t
                g = lsm.add_(entropy[s:e, None]).mul_(-ge).sub_(total).mul_(p)
                del p, lsm
            else:
                g = _softmax(logits[s:e], t).mul_(-total)  # (onehot - p) * gl, the onehot parts below
            g.scatter_add_(-1, labels[s:e], gl)
            grad[s:e] = g
            del g
        return grad, None, None, None, None


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                          chunk_tokens: int | None = None) -> tuple[Tensor, Tensor | None]:
    """log p(label) under softmax(logits / temperature), and the entropy if asked; float32, shape of labels.

    logits: (..., V); labels: (...) long, or (..., m): m labels at each position (the entropy is then (...)).
    Differentiable in logits (both outputs)."""
    shape, lead = labels.shape, logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_tokens or default_chunk_tokens(flat_logits)
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
    chunk = chunk_tokens or default_chunk_tokens(flat)
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
