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

DEFAULT_CHUNK_TOKENS = 512


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """float32 logits / temperature, never writing into the caller's tensor."""
    if chunk.dtype == torch.float32:
        return chunk / temperature if temperature != 1.0 else chunk
    z = chunk.float()  # a fresh copy: dividing in place is safe
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk: int):
        # logits: (N, V) any float dtype; labels: (N,) long
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        mean_z = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, chunk):
            z = _scaled(logits[s:s + chunk], temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse_c
            if with_entropy:
                # H = lse - sum(p * z); keep E_p[z] for the backward
                p = torch.exp(z - lse_c[:, None])
                mz = (p * z).sum(-1)
                mean_z[s:s + chunk] = mz
                entropy[s:s + chunk] = lse_c - mz
            del z
        ctx.save_for_backward(logits, labels, lse, mean_z if with_entropy else lse)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return (logp, entropy) if with_entropy else (logp, torch.zeros(0, device=logits.device))

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        logits, labels, lse, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        t = ctx.temperature
        for s in range(0, logits.shape[0], ctx.chunk):
            z = _scaled(logits[s:s + ctx.chunk], t)
            p = torch.exp(z - lse[s:s + ctx.chunk, None])
            # d logp_label / dz = onehot - p
            g = p * (-grad_logp[s:s + ctx.chunk, None])
            g.scatter_add_(-1, labels[s:s + ctx.chunk, None], grad_logp[s:s + ctx.chunk, None].float())
            if ctx.with_entropy and grad_entropy is not None:
                # dH/dz = -p * (z - E_p[z])
                g -= grad_entropy[s:s + ctx.chunk, None] * p * (z - mean_z[s:s + ctx.chunk, None])
            if t != 1.0:
                g.div_(t)
            grad[s:s + ctx.chunk] = g
            del z, p, g
        return grad, None, None, None, None


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[Tensor, Tensor | None]:
    """log p(label) under softmax(logits / temperature), and the entropy if asked; float32, shape of labels.

    logits: (..., V); labels: (...) long. Differentiable in logits (both outputs)."""
    shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _ChunkedLogProbs.apply(flat_logits, labels.reshape(-1), float(temperature), with_entropy,
                                           chunk_tokens)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


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
