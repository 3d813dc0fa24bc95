"""Top-k and top-p sampling train the distribution they sampled from (lib.logprobs.Truncation, docs/algorithms.md).

The engine samples from the temperature-scaled logits cut to a kept set and renormalised; the trainer's log-probs and
entropy of the policy are taken over the same set: its size at each token comes from the HF engine
(``rollout_kept``), or is rebuilt in the old log-probs' pass with vLLM's rule from the policy's logits. Here: the
truncated log-probs against a plain sort-and-renormalise reference (ties, the boundary token, gradients), the engine's
log-probs against the trainer's on every forward path (the old whole-vocabulary ones shown off by more than 1e-2),
the bytes the sets add, and GRPO/PPO runs under torchrun on a zoo model in every mode, with bypass, rollout correction
and a KL loss."""

from __future__ import annotations

import pytest
import torch

from lib.engine import SamplingConfig
from lib.engine.hf import HFEngine
from lib.forward import KEPT_KEY, response_log_probs
from lib.logprobs import Truncation, head_log_probs, kept_mask, log_probs_from_logits, log_probs_naive
from lib.models import UNFUSED_HEAD_ATTR
from lib.protocol import DataProto
from tests import zoo
from tests.helpers import EOS_IDS, VOCAB, launch_runs, run_rows, tiny_config

FILTERS = {"top_p": (0, 0.9), "top_k": (20, 1.0), "both": (20, 0.9)}
TEMPERATURE = 0.8
CANARY = 1e-5
"""fp32 on both sides measures ~2e-7; the whole vocabulary's log-prob of the same tokens is off by > 1e-2."""


def _naive_keep(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log_probs_naive's kept set of each row (c, V): the tokens whose log-prob it gives finite."""
    vocab = logits.shape[-1]
    return torch.stack([torch.isfinite(log_probs_naive(row.expand(vocab, -1), torch.arange(vocab), 1.0, top_k,
                                                       top_p)[0]) for row in logits])


def _masked_reference(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor):
    """Autograd's reference: log-softmax with the tokens outside ``keep`` at -1e30; (log-probs, entropy)."""
    lsm = torch.log_softmax(logits.masked_fill(~keep, -1e30), -1)
    return lsm.gather(-1, labels[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


def test_truncated_log_probs_match_a_plain_reference_on_ties_and_the_boundary():
    """Sort, keep, renormalise: the chunked and the fused forms equal the plain reference to 1e-6, with ties at the
    k-th logit (all kept, as vLLM keeps them), the top-p boundary token on either side of its mass, a count that
    splits a tie (the normaliser is the engine's whichever tied token it kept), and their gradients."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * 4])
    boundary = torch.log(probs + 1e-12)
    # top-p at 0.79: 0.5 + 0.3 reaches it, the third token goes; at 0.81 it stays
    assert kept_mask(boundary, 0, 0.79).sum().item() == 2 and kept_mask(boundary, 0, 0.81).sum().item() == 3
    ties = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, 0.5]])
    assert kept_mask(ties, 2, 1.0).sum().item() == 4  # the k-th value's ties all stay
    g = torch.Generator().manual_seed(0)
    sharp = torch.randn(16, 256, generator=g) * 4
    for logits, (top_k, top_p) in [(boundary, (0, 0.79)), (boundary, (0, 0.81)), (ties, (2, 1.0)), (ties, (2, 0.95)),
                                   (sharp, (0, 0.9)), (sharp, (20, 1.0)), (sharp, (20, 0.9))]:
        keep = _naive_keep(logits, top_k, top_p)
        assert torch.equal(kept_mask(logits, top_k, top_p), keep)
        counts = keep.sum(-1)
        labels = torch.multinomial(keep.float(), 1, generator=g)[:, 0]
        ref, ref_entropy = log_probs_naive(logits, labels, 1.0, top_k, top_p)
        leaf = logits.clone().requires_grad_()
        logp, entropy, used, disagree = log_probs_from_logits(leaf, labels, 1.0, True, kept=counts,
                                                              rule=Truncation(top_k, top_p), chunk_tokens=7)
        torch.testing.assert_close(logp, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=0)
        assert torch.equal(used, counts) and not disagree.any()
        # gradients of both outputs against autograd through the masked log-softmax
        w, w2 = torch.randn(len(labels), generator=g), torch.randn(len(labels), generator=g)
        (logp * w + entropy * w2).sum().backward()
        plain = logits.clone().requires_grad_()
        a, b = _masked_reference(plain, labels, keep)
        (a * w + b * w2).sum().backward()
        torch.testing.assert_close(leaf.grad, plain.grad, atol=1e-6, rtol=1e-5)
        # fused with the head: the same numbers and both inputs' gradients
        hidden = torch.eye(logits.shape[0], logits.shape[0]).requires_grad_()
        weight = logits.t().contiguous().requires_grad_()  # hidden @ weight.T = logits
        fused = head_log_probs(hidden, weight, labels, 1.0, True, kept=counts, chunk_tokens=5)
        torch.testing.assert_close(fused[0], ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(fused[1], ref_entropy, atol=1e-6, rtol=0)
        (fused[0] * w + fused[1] * w2).sum().backward()
        torch.testing.assert_close(weight.grad.t(), plain.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(hidden.grad, plain.grad @ logits.t(), atol=1e-4, rtol=1e-4)  # sums of 256
    # an engine that kept 2 of the ties (count 2 on [3, 1, 1, 1, ...], its sample the tie at index 2): the normaliser
    # is e^3 + e^1 whichever it kept, and the gradient that of the set it sampled from, {0, 2}
    leaf = ties.clone().requires_grad_()
    logp, entropy = log_probs_from_logits(leaf, torch.tensor([2]), 1.0, True, kept=torch.tensor([2]))[:2]
    exact = torch.zeros_like(ties, dtype=torch.bool)
    exact[0, [0, 2]] = True
    plain = ties.clone().requires_grad_()
    a, b = _masked_reference(plain, torch.tensor([2]), exact)
    torch.testing.assert_close((logp, entropy), (a, b), atol=1e-6, rtol=0)
    (logp + 0.5 * entropy).sum().backward()
    (a + 0.5 * b).sum().backward()
    torch.testing.assert_close(leaf.grad, plain.grad, atol=1e-6, rtol=0)
    # a sampled token below the set the count gives: inside all the same, and said
    out = log_probs_from_logits(ties, torch.tensor([5]), kept=torch.tensor([1]), rule=None)
    assert torch.isfinite(out[0]).all() and out[3].all()


def test_more_labels_beside_the_sampled_token_stay_whole_vocabulary():
    """The distillation top-k path asks for the student's log-probs at the teacher's ids beside the sampled token's:
    the sampled token's (and the entropy) are the kept set's, the others the whole vocabulary's, and the gradient
    of all of them is autograd's."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=g) * 4
    keep = kept_mask(logits, 20, 0.9)
    labels = torch.cat([torch.multinomial(keep.float(), 1, generator=g), torch.randint(0, 300, (16, 3), generator=g)],
                       -1)
    leaf = logits.clone().requires_grad_()
    logp, entropy = log_probs_from_logits(leaf, labels, 1.0, True, kept=keep.sum(-1), chunk_tokens=5)[:2]
    plain = logits.clone().requires_grad_()
    first, ref_entropy = _masked_reference(plain, labels[:, 0], keep)
    rest = torch.log_softmax(plain, -1).gather(-1, labels[:, 1:])
    torch.testing.assert_close(logp, torch.cat([first[:, None], rest], -1), atol=1e-6, rtol=0)
    w = torch.randn(16, 4, generator=g)
    ((logp * w).sum() + entropy.sum()).backward()
    ((torch.cat([first[:, None], rest], -1) * w).sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(leaf.grad, plain.grad, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def policy():
    """A tiny Qwen2 shaped like the real ones (tied, GQA, 2048 ids, two eos ids), its embedding scaled so that its
    distributions range from peaked to flat (top-p 0.9 keeps 1 to ~1,400 tokens)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10.0)
    return model.eval()


def _rollout(model, top_k: int, top_p: float, rows: int = 6) -> DataProto:
    engine = HFEngine(model.config, torch.device("cpu"), 0, EOS_IDS,
                      SamplingConfig(temperature=TEMPERATURE, top_k=top_k, top_p=top_p, n=2, max_new_tokens=12,
                                     seed=3), dtype=torch.float32)
    engine.wake_up(["weights"])
    engine.load_weights(model.named_parameters())
    engine.wake_up(["kv_cache"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (rows, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0  # left padding on half the prompts
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return engine.generate(DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos}))


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_the_trainers_log_probs_are_the_engines_on_every_forward(policy, name):
    """The HF engine's rollout with the filter: the trainer's truncated log-probs of the sampled tokens equal the
    engine's at fp32's floor, padded and packed, the fused head on and off, the kept sets agree (no disagreement,
    the engine's counts are the rule's on the trainer's logits), and the entropy is the kept set's. The old
    behaviour, the whole vocabulary's log-prob of the same tokens, is off by more than 1e-2: the test can fail."""
    top_k, top_p = FILTERS[name]
    out = _rollout(policy, top_k, top_p)
    b = out.batch
    mask = b["response_mask"].bool()
    kept = b[KEPT_KEY]
    assert kept.dtype == torch.int32 and (kept[mask] > 0).all() and (kept[mask] < VOCAB).all()
    if top_k:
        assert (kept[mask] <= top_k).all()
    with torch.no_grad():
        whole, _ = response_log_probs(policy, out, TEMPERATURE)
        logits = policy(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=b["position_ids"]).logits[:, -b["responses"].shape[1] - 1:-1]
        _, ref_entropy = log_probs_naive(logits[mask], b["responses"][mask], TEMPERATURE, top_k, top_p)
    gap = ((whole - b["rollout_log_probs"]).abs()[mask]).mean().item()
    assert gap > 1e-2, gap  # what the trainer computed before: another distribution than the one sampled
    for packed in (False, True):
        for fused in (True, False):
            setattr(policy, UNFUSED_HEAD_ATTR, not fused)
            try:
                with torch.no_grad():
                    logp, entropy, used, disagree = response_log_probs(
                        policy, out, TEMPERATURE, packed=packed, with_entropy=True,
                        truncation=Truncation(top_k, top_p), measure=True)
            finally:
                setattr(policy, UNFUSED_HEAD_ATTR, False)
            diff = (logp - b["rollout_log_probs"]).abs()[mask].max().item()
            assert diff < CANARY, (packed, fused, diff)
            assert torch.equal(used[mask].long(), kept[mask].long()) and not disagree[mask].any()
            torch.testing.assert_close(entropy[mask], ref_entropy, atol=1e-5, rtol=0)


def test_the_kept_sets_cost_four_bytes_a_token(policy):
    """The sets travel as one int32 count per response position: the rollout's bytes grow by exactly 4 a token
    over the same rollout without a filter, and nothing per vocabulary entry."""
    def nbytes(data: DataProto) -> int:
        return sum(t.numel() * t.element_size() for t in data.batch.values())

    plain, filtered = _rollout(policy, 0, 1.0), _rollout(policy, 20, 0.9)
    assert KEPT_KEY not in plain.batch and set(filtered.batch) == set(plain.batch) | {KEPT_KEY}
    tokens = filtered.batch["responses"].numel()
    assert nbytes(filtered) - nbytes(filtered.select([k for k in filtered.batch if k != KEPT_KEY])) == 4 * tokens


def test_the_update_reads_the_sets_it_was_given(policy):
    """The update's forward takes the batch's counts: another count at a token gives that set's log-prob (the token's
    logit against the log-sum-exp of the policy's n largest); a sampled token without a count is refused (the old
    log-probs' pass fills them) rather than another distribution trained."""
    out = _rollout(policy, 20, 0.9)
    b, truncation = out.batch, Truncation(20, 0.9)
    row, col = [int(i[0]) for i in torch.nonzero(b["response_mask"] > 0, as_tuple=True)]
    with torch.no_grad():
        logits = policy(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=b["position_ids"]).logits[row, -b["responses"].shape[1] - 1 + col] / TEMPERATURE
    token = int(b["responses"][row, col])
    for n in (int(b[KEPT_KEY][row, col]), 50):
        b[KEPT_KEY][row, col] = n
        n = max(n, int((logits >= logits[token]).sum()))  # the sampled token inside
        with torch.no_grad():
            logp = response_log_probs(policy, out, TEMPERATURE, truncation=truncation)[0][row, col]
        assert abs(float(logp) - float(logits[token] - logits.topk(n).values.logsumexp(0))) < 1e-5, n
    b[KEPT_KEY][row, col] = 0
    with pytest.raises(ValueError, match="old log-probs' pass"):
        response_log_probs(policy, out, TEMPERATURE, truncation=truncation)
    filled = response_log_probs(policy, out, TEMPERATURE, truncation=truncation, measure=True)[2]
    assert filled[row, col] > 0  # the rule's count, from the policy's logits


# ---- GRPO and PPO as users run them: train_grpo.py / train_ppo.py on 2 ranks, a zoo model (vocabulary 2048)

RUNS = {  # name: (script, flags)
    "fsdp_top_p": ("train_grpo.py", ["--actor.fsdp.shard_size", "0", "--rollout.top_p", "0.9"]),
    "padded_top_k": ("train_grpo.py", ["--actor.batching.no-use-remove-padding", "--rollout.top_k", "20"]),
    "sp2_both": ("train_grpo.py", ["--actor.fsdp.shard_size", "0", "--trainer.sp_size", "2", "--rollout.top_k", "20",
                                   "--rollout.top_p", "0.9"]),
    "unfused_both_kl": ("train_grpo.py", ["--actor.model.fused_head", "off", "--rollout.top_k", "20",
                                          "--rollout.top_p", "0.9", "--actor.use_kl_loss"]),
    "bypass_top_p": ("train_grpo.py", ["--algorithm.bypass_mode", "--rollout.top_p", "0.9"]),
    "correction_top_k": ("train_grpo.py", ["--algorithm.rollout_correction", "token", "--rollout.top_k", "20"]),
    "lora_top_p": ("train_grpo.py", ["--actor.lora.rank", "8", "--rollout.top_p", "0.9"]),
    "ppo_both": ("train_ppo.py", ["--critic.mini_batch_size", "8", "--algorithm.critic_warmup", "0",
                                  "--rollout.top_k", "20", "--rollout.top_p", "0.9"]),
}


@pytest.fixture(scope="module")
def filtered_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("filtered_runs")
    model = zoo.build("qwen2_tied", str(root / "zoo"))
    plan = [(name, script, [*zoo.grpo_args(model, str(root), name, str(root)), "--rollout.temperature",
                            str(TEMPERATURE), *flags]) for name, (script, flags) in RUNS.items()]
    return root, launch_runs(plan, root)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_runs_with_top_k_and_top_p_train_the_distribution_they_sample(filtered_runs, name):
    """Two steps of each mode: the canary at fp32's floor every step (before, it was not applied with a filter),
    the engine's and the trainer's kept sets never differ, and the sets are what the filter keeps."""
    rows = run_rows(filtered_runs, name, steps=2)
    for r in rows:
        assert r["rollout/logp_abs_diff"] < CANARY, r
        assert r["rollout/filter_disagreement"] == 0.0, r
        top_k = 20 if "top_k" in name or "both" in name else 0
        assert 1 <= r["rollout/kept_tokens"] <= (top_k or VOCAB), r
        assert r["actor/grad_norm"] > 0, r
        # one mini-batch: the update's first forward is the old pass's policy, under the same sets (whole
        # vocabulary log-probs against the truncated old ones would give a KL of ~0.1 here)
        assert abs(r["actor/ppo_kl"]) < 1e-6 and r["actor/pg_clipfrac"] == 0, r
    if name.startswith("correction"):  # the weights measure a train/rollout mismatch, none here: not the filter's
        assert all(abs(r["rollout_is_mean"] - 1) < 1e-4 and r["rollout_is_frac_clipped"] == 0 for r in rows), rows
    assert filtered_runs[1].returncode == 0, filtered_runs[1].stdout[-3000:] + filtered_runs[1].stderr[-5000:]


# ---- vLLM (its CPU build: the vllm marker's pass): the rule, and GRPO with the engine in every filter

@pytest.mark.vllm
def test_the_trainers_rule_is_vllms(monkeypatch):
    """lib.logprobs.kept_mask keeps what vLLM's sort-based apply_top_k_top_p keeps (its CPU build always, CUDA once
    lib.engine.vllm_adapter.exact_filter_rule turned its Triton kernel off): random, bf16-valued (ties everywhere)
    and hand-made tied logits, 8 rows and more (where 0.25 would take the kernel), each filter."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops import topk_topp_sampler

    from lib.engine.vllm_adapter import exact_filter_rule

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(16, 2048, generator=g) * 3, (torch.randn(16, 2048, generator=g) * 3).bfloat16().float(),
             torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, 0.5]] * 8)]
    for logits in cases:
        for name, (top_k, top_p) in FILTERS.items():
            k = torch.full((logits.shape[0],), min(top_k or logits.shape[1], 2 if logits.shape[1] == 8 else 10**9))
            kk = k if top_k else None
            pp = torch.full((logits.shape[0],), top_p, dtype=torch.float32) if top_p < 1 else None
            theirs = torch.isfinite(topk_topp_sampler.apply_top_k_top_p_pytorch(logits.clone(), kk, pp))
            ours = kept_mask(logits, int(kk[0]) if kk is not None else 0, top_p)
            assert torch.equal(ours.sum(-1), theirs.sum(-1)), name  # tied logits split by sort order: same count
    monkeypatch.setattr(topk_topp_sampler, "HAS_TRITON", True)
    exact_filter_rule(torch.device("cpu"), SamplingConfig(top_p=0.9))
    assert topk_topp_sampler.HAS_TRITON  # the CPU build has no kernel to turn off
    exact_filter_rule(torch.device("cuda"), SamplingConfig(top_p=1.0))
    assert topk_topp_sampler.HAS_TRITON  # no filter: vLLM's own choice
    exact_filter_rule(torch.device("cuda"), SamplingConfig(top_p=0.9))
    assert not topk_topp_sampler.HAS_TRITON


def _vllm_policy(folder) -> str:
    """A zoo Qwen2 (tied, GQA, 2048 ids, chat template, two eos ids) with the head size vLLM's CPU attention takes
    (32), its embedding scaled so that its distributions range from peaked to flat (top-p 0.9 keeps 1 to ~950
    tokens)."""
    from transformers import AutoModelForCausalLM

    config = zoo.config("qwen2_tied")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(6.0)
    return zoo._save(model, str(folder))


@pytest.mark.vllm
def test_grpo_with_vllm_trains_the_distribution_it_sampled(tmp_path):
    """Two GRPO steps on 2 ranks with vLLM's CPU build for each filter (packed; and FSDP over both ranks with SP 2;
    the trainer's other paths are the engine's alike, tested above with the HF engine): the trainer rebuilds the
    kept sets with vLLM's rule and the canary stays at fp32's floor (vLLM's processed log-probs against the
    trainer's truncated ones), no sampled token outside the rebuilt set."""
    pytest.importorskip("vllm")
    model = _vllm_policy(tmp_path / "model")
    runs = {name: (k, p, []) for name, (k, p) in FILTERS.items()}  # packed, the replica on each rank
    runs["fsdp_sp2_both"] = (*FILTERS["both"], ["--actor.fsdp.shard_size", "0", "--trainer.sp_size", "2"])
    plan = [(name, "train_grpo.py", [*zoo.grpo_args(model, str(tmp_path), name, str(tmp_path)), "--rollout.engine",
                                     "vllm", "--rollout.enforce_eager", "--rollout.temperature", str(TEMPERATURE),
                                     *(["--rollout.top_k", str(k)] if k else []), "--rollout.top_p", str(p), *flags])
            for name, (k, p, flags) in runs.items()]
    launched = tmp_path, launch_runs(plan, tmp_path)
    for name, (top_k, _, _) in runs.items():
        rows = run_rows(launched, name, steps=2)
        for r in rows:
            assert r["rollout/logp_abs_diff"] < CANARY, (name, r)
            assert r["rollout/filter_disagreement"] == 0.0 and 1 <= r["rollout/kept_tokens"] <= (top_k or VOCAB), r
    assert launched[1].returncode == 0, launched[1].stdout[-3000:] + launched[1].stderr[-5000:]
