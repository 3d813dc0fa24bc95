"""On-policy distillation (Agarwal et al. 2024; Thinking Machines, "On-Policy Distillation", 2025): the student samples,
a frozen teacher gives the log-probability of every sampled token, and the student moves toward the teacher.

With ``d_t = log p_teacher(y_t) - log p_student(y_t)`` on each sampled response token y_t (both at the rollout
temperature, the distribution the student sampled from; observation tokens of multi-turn rows are not scored):

- ``distill.mode=reward``: ``d_t`` times ``distill.coef`` is the token's reward with discount 0, which is its
  advantage: ``A_t = coef * d_t`` (pure distillation, ``distill.task_reward`` false), or the GRPO advantage of the task
  reward plus it (true). The student's log-probs are the trainer's ``old_log_probs``; the policy loss is the
  configured one. ``-d_t`` is a one-sample estimate of the per-token reverse KL(student || teacher), so the policy
  gradient with these advantages descends it.
- ``distill.mode=loss``: ``coef * agg(k(t))`` is added to the policy loss (the advantages stay the task's, or zero),
  ``k`` computed from the current student's log-probs (with their gradient) and the teacher's: on the sampled token
  ``k1 = -d``, ``k3 = exp(d) - d - 1`` (clamped as lib.algos.kl_k3); or ``topk``, at every response position the exact
  reverse KL between the student's and the teacher's distributions coarsened to k + 1 outcomes, the teacher's k =
  ``distill.topk`` most likely tokens S_t and all others as one:
  ``sum_{c in S_t + rest} p_S(c) (log p_S(c) - log p_T(c))``. The teacher's rest is its exact logsumexp over the
  other tokens; the student's is ``1 - sum_{S_t} p_S`` (floored at lib.algos.TAIL_FLOOR). A lower bound of the whole
  reverse KL (coarsening loses information), equal to it at k = the vocabulary size; it uses every token of S_t
  (not only the sampled one), so its gradient has no sampling noise at the position.

Metrics: ``distill/reverse_kl`` (the mean of ``-d`` over response tokens), ``distill/teacher_logp`` and
``distill/student_logp`` (means over response tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lib.actor import compute_log_probs, compute_top_log_probs
from lib.fsdp import load_model, offload_model
from lib.protocol import DataProto

Tensor = torch.Tensor

TEACHER_KEY = "teacher_log_probs"
TOPK_KEYS = ("teacher_topk_log_probs", "teacher_topk_ids")
"""estimator=topk's teacher columns: (B, R, k + 1) log-probs (the k tokens, then the rest) and (B, R, k) ids."""


def enabled(cfg: Any) -> bool:
    """``cfg``: the whole Config."""
    return bool(cfg.distill.teacher)


def vocabulary_problem(student: Any, teacher: Any, teacher_path: str) -> str:
    """Why the teacher cannot score the student's tokens ("" if it can): the two tokenizers must map the same
    strings to the same ids."""
    own, theirs = student.get_vocab(), teacher.get_vocab()
    if own == theirs:
        return ""
    differ = sorted(set(own.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
    return (f"distill.teacher={teacher_path}: its tokenizer's vocabulary differs from the student's ({len(theirs)} vs "
            f"{len(own)} tokens; first differences {differ}): the teacher would score other tokens than the student "
            f"sampled; use a teacher of the student's family (the same tokenizer)")


def offloads(cfg: Any, device: Any) -> bool:
    """Whether the teacher waits on the CPU between uses (distill.teacher_offload, on a GPU)."""
    return cfg.distill.teacher_offload and device.type == "cuda"


@contextlib.contextmanager
def on_device(teacher: Any, device: Any, offload: bool) -> Iterator[None]:
    """The teacher on ``device`` for the block: an offloaded one (``offloads``) comes and goes back after it."""
    if offload:
        load_model(teacher, device)
    try:
        yield
    finally:
        if offload:
            offload_model(teacher)


def teacher_log_probs(teacher: Any, batch: DataProto, batching: Any, topo: Any, temperature: float,
                      offload: bool = False, topk: int = 0) -> None:
    """The teacher's log-prob of every sampled token, at the rollout temperature, as ``teacher_log_probs``; with
    ``topk``, from the same forward, its top-k tokens at every response position (TOPK_KEYS). An offloaded teacher
    comes to the device for it and goes back."""
    with on_device(teacher, topo.device, offload):
        if topk:
            batch.batch[TEACHER_KEY], *top = compute_top_log_probs(teacher, batch, batching, topo, topk, temperature)
            batch.batch.update(dict(zip(TOPK_KEYS, top)))
        else:
            batch.batch[TEACHER_KEY], _ = compute_log_probs(teacher, batch, batching, topo, temperature)


def token_term(batch: DataProto, coef: float) -> Tensor:
    """``coef * (log p_teacher - log p_student)`` on the response tokens (0 elsewhere), (B, R)."""
    b = batch.batch
    return coef * (b[TEACHER_KEY] - b["old_log_probs"]) * b["response_mask"].to(torch.float32)


def set_advantages(batch: DataProto, cfg: Any) -> None:
    """The advantages with the teacher: the task's GRPO advantage (``distill.task_reward``) or none, plus, in reward
    mode, the teacher term (discount 0). Loss mode adds its term in the update (lib.actor.update_policy)."""
    d, b = cfg.distill, batch.batch
    adv = b["advantages"] if d.task_reward else torch.zeros_like(b["advantages"])
    if d.mode == "reward":
        adv = adv + token_term(batch, d.coef)
    b["advantages"], b["returns"] = adv, adv.clone()


def topk(cfg: Any) -> int:
    """The teacher's tokens per position that the run needs (estimator=topk's k), or 0."""
    return cfg.distill.topk if cfg.distill.mode == "loss" and cfg.distill.estimator == "topk" else 0


def loss_kwargs(cfg: Any) -> dict[str, Any]:
    """What lib.actor.update_policy takes for the loss mode's term (nothing in reward mode or without a teacher)."""
    if not enabled(cfg) or cfg.distill.mode != "loss":
        return {}
    return {"teacher_kl": (cfg.distill.coef, cfg.distill.estimator)}


def metrics(batch: DataProto) -> dict[str, float]:
    """Means over this rank's response tokens (the logger averages over ranks)."""
    b = batch.batch
    mask = b["response_mask"].to(torch.float32)
    n = mask.sum().clamp(min=1)
    teacher, student = (b[TEACHER_KEY] * mask).sum() / n, (b["old_log_probs"] * mask).sum() / n
    gap = ((b["old_log_probs"] - b[TEACHER_KEY]) * mask).sum() / n  # not student - teacher: two large means cancel
    return {"distill/reverse_kl": float(gap), "distill/teacher_logp": float(teacher),
            "distill/student_logp": float(student)}
