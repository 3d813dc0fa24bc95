"""Token log-probs and entropy from logits without a full-size float32 log-softmax.

At V = 151936 and T = 4096 a float32 (T, V) tensor is 2.5 GB; the naive
``log_softmax(logits.float(), -1).gather(...)`` makes two of them (the cast and the result), and autograd
keeps them. Here tokens are processed in chunks: forward keeps only (N,) statistics, backward recomputes
each chunk's softmax and writes the gradient in the logits' dtype. ``log_probs_naive`` is the plain
reference that the tests and bench/bench_algos.py compare against.

With top-k/top-p sampling (``Truncation``) the log-probs and the entropy are those of the distribution the engine
sampled from: the softmax over the kept tokens only, renormalised. The kept set travels as one count per position
(``kept``, the engine's, or reconstructed here with the engines' rule, ``kept_mask``); the trainer keeps its own n most
likely tokens (tokens tied at the boundary share the remaining places, so the normaliser is exact whichever of them
the engine kept), and the sampled token is always inside.

``head_log_probs`` goes one step further (the forwards' default, lib.forward): it takes the LM head's input and
weight, makes each chunk's logits, uses them and drops them, in forward and again in backward, so the (T, V) logits
tensor and its gradient never exist (at T = 32768 in bf16: 2 x 10 GB); the price is the head's matmul once more.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def default_chunk_tokens(vocab: int, device: torch.device, fused: bool = False, truncated: bool = False) -> int:
    """Tokens per chunk: ~0.3 GB of float32 logits on GPU (large kernels), ~16 MB on CPU, where the allocator
    returns big blocks to the OS and every fresh one costs page faults (measured: 2x slower at 512 tokens). The fused
    head reads its whole weight for every chunk, four times: ~256 MB on CPU (measured at 1024 tokens, vocab 32768,
    hidden 256, with other work on the 2 cores: 16 MB chunks took 3.1x the unfused time, 256 MB ones 1.06x)."""
    if device.type == "cuda":
        budget = 512 * 151936 * 4
    else:
        budget = 256 * 2**20 if fused else 16 * 2**20
    # a top-k/top-p chunk holds ~3x the float32 logits (the rule's sort and its indices, the kept sets' weights)
    return max(1, budget // (4 * vocab * (3 if truncated else 1)))


@dataclass(frozen=True)
class Truncation:
    """The engines' top-k / top-p filter, applied after the temperature (vLLM's order)."""

    top_k: int = 0
    """Keep the k highest logits (and every token tied with the k-th). 0: off."""
    top_p: float = 1.0
    """Then keep the smallest set of most likely tokens whose mass reaches top_p (1: off)."""

    @property
    def on(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def kept_mask(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Which tokens the filter keeps, (c, V) bool, from float32 logits already divided by the temperature: vLLM's
    rule (v1 sampler, apply_top_k_top_p's PyTorch form, in every release we support). Top-k keeps the logits >= the
    k-th largest. Top-p then sorts the kept logits ascending, takes their softmax's running sum and drops a token
    while that sum is <= 1 - top_p (in float32, as vLLM's float32 top_p tensor gives it); the largest always stays.
    The number kept does not depend on how a sort orders tied logits."""
    vocab = scaled.shape[-1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep = scaled >= scaled.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1.0:
        low, order = scaled.masked_fill(~keep, float("-inf")).sort(dim=-1)
        mass = low.softmax(-1).cumsum_(-1)
        drop = mass <= 1 - torch.tensor(top_p, dtype=torch.float32, device=scaled.device)
        drop[:, -1] = False
        keep = keep & ~torch.zeros_like(drop).scatter_(-1, order, drop)
    return keep


@dataclass
class _Kept:
    """One chunk's kept sets, per row (c, 1) each: ``low``, the ``counts``-th largest scaled logit; ``left``, the
    places it leaves to the tokens tied with it (``ties`` of them: they share them, log-weight log(left / ties)
    each, so the normaliser is the engine's whatever tie it broke); ``log_z``, the set's log normaliser. The
    sampled token (the first label), which the engine kept, takes a whole place when tied (the other ties share the
    rest) and is put inside when below ``low`` (``outside``). ``counts`` (c,) the sizes used, ``disagree`` (c,)
    where the sampled token fell outside or the rule's count differed from the engine's."""
    low: Tensor
    left: Tensor
    ties: Tensor
    log_z: Tensor
    counts: Tensor
    disagree: Tensor

    def stats(self) -> Tensor:
        """(c, 4): what backward needs again (``_saved_kept``)."""
        return torch.cat([self.low, self.left, self.ties, self.log_z], -1)

    def weights(self, scaled: Tensor, label: Tensor) -> Tensor:
        """(c, V) float32: 1 above ``low``, the tied tokens' shares, 0 below; the sampled token 1."""
        label_tied = scaled.gather(-1, label) == self.low
        share = torch.where(label_tied, (self.left - 1) / (self.ties - 1).clamp(min=1),
                            self.left / self.ties.clamp(min=1))
        weight = (scaled >= self.low).float()
        if bool((share != 1).any()):  # ties sharing fewer places than they are (bf16-valued logits, mostly)
            weight = torch.where(scaled == self.low, share, weight)
        return weight.scatter_(-1, label, 1.0)


def _kept(scaled: Tensor, labels: Tensor, kept: Tensor, rule: Truncation | None
          ) -> tuple[_Kept, Tensor, Tensor, Tensor, Tensor]:
    """The kept sets of a chunk's rows from its scaled logits (c, V). ``kept`` (c,): the engine's counts, 0 where it
    gave none (filled with ``rule``'s counts from these logits); with ``rule`` the rule's counts are also compared
    with the engine's. Also returns what the forward makes the log-prob and the entropy from: the rows' scaled - max
    (c, V), its exp cut to the tokens above ``low`` (c, V), the max (c, 1) and the sampled token's scaled logit
    (c, 1)."""
    counts = kept.long()
    differ = torch.zeros_like(counts, dtype=torch.bool)
    if rule is not None:
        own = kept_mask(scaled, rule.top_k, rule.top_p).sum(-1)
        differ = (counts > 0) & (counts != own)
        counts = torch.where(counts > 0, counts, own)
    counts = counts.clamp(1, scaled.shape[-1])
    high = scaled.topk(int(counts.max()), dim=-1).values
    top, low = high[:, :1], high.gather(-1, (counts - 1)[:, None])
    above = scaled > low
    n_above = above.sum(-1, keepdim=True)
    ties = (scaled >= low).sum(-1, keepdim=True) - n_above
    left = (counts[:, None] - n_above).float()
    shifted = scaled - top
    exp = shifted.exp().masked_fill_(~above, 0.0)
    label = scaled.gather(-1, labels[:, :1])
    outside = label < low
    # the normaliser: the tokens above, the places left at low, and a sampled token below them put inside
    z = exp.sum(-1, keepdim=True) + left * (low - top).exp() + outside * (label - top).exp()
    k = _Kept(low, left, ties.float(), top + z.log(), counts, differ | outside[:, 0])
    return k, shifted, exp, top, label


def _saved_kept(z: Tensor, stats: Tensor, temperature: float) -> tuple[Tensor, _Kept] | None:
    """Backward's scaled logits and kept sets (forward's ``_Kept.stats``), or None without a truncation."""
    if stats.numel() == 0:
        return None
    low, left, ties, log_z = stats.split(1, -1)
    empty = torch.zeros(0, device=z.device)
    return _scaled(z, temperature), _Kept(low, left, ties, log_z, empty, empty)


def _chunk_forward(z: Tensor, labels: Tensor, temperature: float, with_entropy: bool,
                   kept: tuple[_Kept, Tensor, Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """One chunk's log p(labels) (c, m) and entropy (c,) (None unless asked), float32, from its logits z (c, V).
    ``kept`` (``_kept``'s, ``z`` then the scaled logits): the sampled token's (the first label's) log-prob and the
    entropy are those of the kept set; the other labels' stay the whole vocabulary's."""
    if kept is not None:
        k, shifted, exp, top, label = kept
        lp = label - k.log_z
        if labels.shape[1] > 1:
            lp = torch.cat([lp, torch.log_softmax(z, -1).gather(-1, labels[:, 1:])], -1)
        if not with_entropy:
            return lp, None
        # H = -sum_j w_j p_j log p_j, p_j = exp(z_j - log_z): the tokens above low, the places at low, an outside
        # label; every term taken relative to the row's max (no large values that cancel)
        outside = label < k.low
        norm = (k.log_z - top).exp()  # sum of w * exp(z - top)
        total = torch.linalg.vecdot(exp, shifted)[:, None] - (k.log_z - top) * exp.sum(-1, keepdim=True)
        total = total + k.left * (k.low - top).exp() * (k.low - k.log_z)
        total = total + outside * (label - top).exp() * (label - k.log_z)
        return lp, -(total / norm)[:, 0]
    lsm = _log_softmax(z, temperature)  # one fused pass
    # H = -sum(p * log p), from log p directly (lse - E_p[z] cancels badly when both are large)
    return lsm.gather(-1, labels), (-torch.linalg.vecdot(lsm.exp(), lsm) if with_entropy else None)


def _chunk_grad(z: Tensor, labels: Tensor, grad_logp: Tensor, grad_entropy: Tensor | None, entropy: Tensor,
                temperature: float, kept: tuple[Tensor, _Kept] | None = None) -> Tensor:
    """d loss / d z (c, V) float32 of one chunk, from the gradients of its log-probs (c, m) and, where the loss uses
    it, of its entropy (c,). ``kept``: (the scaled logits, the kept sets) of a truncation (``_saved_kept``)."""
    # d/dlogits = d/dz / t: fold 1/t into the incoming gradients instead of a pass over the chunk
    gl = grad_logp.float() / temperature  # (c, m)
    if kept is not None:
        # the kept set's q = w * p: d logp_label/dz = onehot - q; dH/dz = -q * (log p + H); the other labels'
        # (whole vocabulary): onehot - softmax
        scaled, k = kept
        inside = scaled - k.log_z  # log p, were the token kept
        q = inside.exp().mul_(k.weights(scaled, labels[:, :1]))
        g = q.mul(-gl[:, :1])
        if grad_entropy is not None:
            ge = grad_entropy[:, None].float() / temperature
            g.sub_(inside.add_(entropy[:, None]).mul_(q).mul_(ge))
        del q, inside
        if labels.shape[1] > 1:
            g.sub_(torch.softmax(scaled, -1).mul_(gl[:, 1:].sum(-1, keepdim=True)))
        return g.scatter_add_(-1, labels, gl)
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


def _outputs(n: int, labels: Tensor, with_entropy: bool, device: torch.device, truncated: bool = False
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty outputs: log-probs, entropy, and with a truncation the counts used, the disagreements and the kept
    sets' statistics for backward (``_Kept.stats``)."""
    entropy = torch.empty(n, dtype=torch.float32, device=device) if with_entropy else torch.zeros(0, device=device)
    rows = n if truncated else 0
    return (torch.empty(labels.shape, dtype=torch.float32, device=device), entropy,
            torch.empty(rows, dtype=torch.long, device=device), torch.empty(rows, dtype=torch.bool, device=device),
            torch.empty((rows, 4), dtype=torch.float32, device=device))


def _chunks(n: int, chunk: int, kept: Tensor | None) -> Iterator[tuple[int, int, Tensor | None]]:
    for s in range(0, n, chunk):
        yield s, s + chunk, None if kept is None else kept[s:s + chunk]


def _forward_chunk(z: Tensor, s: int, e: int, labels: Tensor, temperature: float, with_entropy: bool,
                   kept: Tensor | None, rule: Truncation | None, out: tuple[Tensor, ...]) -> None:
    """One chunk's outputs written into ``out`` (_outputs)."""
    logp, entropy, counts, disagree, stats = out
    k = None
    if kept is not None:
        z = _scaled(z, temperature)
        k, temperature = _kept(z, labels[s:e], kept, rule), 1.0
    lp, ent = _chunk_forward(z, labels[s:e], temperature, with_entropy, k)
    logp[s:e] = lp
    if with_entropy:
        entropy[s:e] = ent
    if k is not None:
        counts[s:e], disagree[s:e], stats[s:e] = k[0].counts, k[0].disagree, k[0].stats()


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk: int,
                kept: Tensor | None, rule: Truncation | None):
        # logits: (N, V) any float dtype; labels: (N, m) long, m labels per position; kept (N,) or None
        out = _outputs(logits.shape[0], labels, with_entropy, logits.device, kept is not None)
        for s, e, k in _chunks(logits.shape[0], chunk, kept):
            _forward_chunk(logits[s:e], s, e, labels, temperature, with_entropy, k, rule, out)
        ctx.save_for_backward(logits, labels, out[1], out[4])
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.mark_non_differentiable(out[2], out[3])
        # an output the loss does not use (the entropy at entropy_coef 0, logged only) comes to backward as None,
        # not as zeros that would cost the entropy's gradient pass over every chunk
        ctx.set_materialize_grads(False)
        return out[:4]

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor, _counts: Any, _disagree: Any):
        logits, labels, entropy, stats = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad_logp, grad_entropy = _incoming(grad_logp, grad_entropy, labels, ctx.with_entropy)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            grad[s:e] = _chunk_grad(logits[s:e], labels[s:e], grad_logp[s:e],
                                    None if grad_entropy is None else grad_entropy[s:e], entropy[s:e],
                                    ctx.temperature, _saved_kept(logits[s:e], stats[s:e], ctx.temperature))
        return grad, None, None, None, None, None, None


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
                chunk: int, banned: Tensor | None, ban_value: float, kept: Tensor | None, rule: Truncation | None):
        # hidden: (N, H); weight: (V, H), the head's; labels: (N, m); kept (N,) or None
        out = _outputs(hidden.shape[0], labels, with_entropy, hidden.device, kept is not None)
        for s, e, k in _chunks(hidden.shape[0], chunk, kept):
            z = _head_chunk(hidden[s:e], weight, banned, ban_value)
            _forward_chunk(z, s, e, labels, temperature, with_entropy, k, rule, out)
            del z
        ctx.save_for_backward(hidden, weight, labels, out[1], banned, out[4])
        ctx.temperature, ctx.with_entropy, ctx.chunk, ctx.ban_value = temperature, with_entropy, chunk, ban_value
        ctx.mark_non_differentiable(out[2], out[3])
        ctx.set_materialize_grads(False)
        return out[:4]

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor, _counts: Any, _disagree: Any):
        hidden, weight, labels, entropy, banned, stats = ctx.saved_tensors
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
                            entropy[s:e], ctx.temperature, _saved_kept(z, stats[s:e], ctx.temperature))
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
                None, None, None, None, None, None, None, None)


def head_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, banned: Tensor | None = None, ban_value: float = 0.0,
                   chunk_tokens: int | None = None, kept: Tensor | None = None, rule: Truncation | None = None
                   ) -> tuple[Tensor | None, ...]:
    """``log_probs_from_logits(hidden @ weight.T, ...)`` (the ``banned`` columns of the logits set to ``ban_value``)
    without making the logits: the LM head fused with the chunked log-prob (and entropy), its matmul redone per chunk
    in backward. hidden (N, H); weight (V, H); labels (N,) or (N, m). Differentiable in hidden and weight.
    ``kept``, ``rule``: as log_probs_from_logits."""
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], hidden.device, True, kept is not None)
    flat_labels = labels if labels.dim() == 2 else labels[:, None]
    logp, entropy, counts, disagree = _FusedHeadLogProbs.apply(hidden, weight, flat_labels, float(temperature),
                                                               with_entropy, chunk, banned, float(ban_value),
                                                               _flat_kept(kept), rule)
    out = (logp.view(labels.shape), (entropy if with_entropy else None))
    return out if kept is None else (*out, counts, disagree)


def _flat_kept(kept: Tensor | None) -> Tensor | None:
    return None if kept is None else kept.reshape(-1).long()


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                          chunk_tokens: int | None = None, kept: Tensor | None = None,
                          rule: Truncation | None = None) -> tuple[Tensor | None, ...]:
    """log p(label) under softmax(logits / temperature), and the entropy if asked; float32, shape of labels.

    logits: (..., V); labels: (...) long, or (..., m): m labels at each position (the entropy is then (...)).
    Differentiable in logits (both outputs).

    ``kept`` (...) ints: top-k/top-p sampling's kept set at each position, as the number of tokens kept (0: the
    engine gave none, ``rule``'s count from these logits is taken). The log-prob of the first label and the entropy
    are then the kept set's (module docstring); two more outputs follow, (...) each: the counts used and where the
    sampled token fell outside the set or ``rule``'s count differs from the engine's."""
    shape, lead = labels.shape, logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_tokens or default_chunk_tokens(flat_logits.shape[-1], flat_logits.device, truncated=kept is not None)
    flat_labels = labels.reshape(-1, labels.shape[-1] if labels.dim() == logits.dim() else 1)
    logp, entropy, counts, disagree = _ChunkedLogProbs.apply(flat_logits, flat_labels, float(temperature),
                                                             with_entropy, chunk, _flat_kept(kept), rule)
    out = (logp.view(shape), (entropy.view(lead) if with_entropy else None))
    return out if kept is None else (*out, counts.view(lead), disagree.view(lead))


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


def log_probs_naive(logits: Tensor, labels: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                    ) -> tuple[Tensor, Tensor]:
    """The plain reference: a full float32 log-softmax. (log-probs, entropy). With ``top_k``/``top_p``: each row's
    logits sorted, the k highest kept, then the shortest head of the sort whose mass reaches top_p, the rest set to
    -inf and the softmax renormalised over what is left."""
    scaled = logits.float() / temperature
    if top_k or top_p < 1:
        flat = scaled.reshape(-1, scaled.shape[-1])
        high, order = flat.sort(-1, descending=True)
        cut = torch.full_like(high, float("-inf"))
        for row in range(flat.shape[0]):
            keep = high.shape[-1]
            if 0 < top_k < keep:  # the k highest, and every token tied with the k-th
                keep = int((high[row] >= high[row, top_k - 1]).sum())
            if top_p < 1:  # then a token stays while the mass before it is below top_p
                probs = torch.softmax(high[row, :keep], -1)
                keep = int(((probs.cumsum(-1) - probs) < top_p).sum())
            cut[row, :keep] = high[row, :keep]
        scaled = torch.zeros_like(flat).scatter_(-1, order, cut).view(scaled.shape)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -torch.nan_to_num(logp_all.exp() * logp_all).sum(-1)  # a cut token: 0 x -inf counts 0
    return logp, entropy
