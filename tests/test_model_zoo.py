"""The model zoo (tests/zoo.py): real architectures at toy size, each checked in every mode users run.

- In one process: the HF engine's rollout log-probs, the packed and the padded trainer paths all equal
  transformers' eager forward (fp32, < 1e-4), with sequences longer than the sliding windows.
- End to end: 2 GRPO steps of train_grpo.py on 2 gloo ranks with FSDP (shard_size 0) for every model; with the plain
  replica (shard_size 1) and with Ulysses sp_size 2 for the models whose features those modes touch (MODE_CASES);
  every step's rollout/logp_abs_diff < 1e-4, and the export's logits equal those of the trained weights (tied
  embeddings stay one matrix); persistent buffers come back as given. One torchrun launch per mode runs its models
  (tests/runs_driver.py), so the ranks start three times, not once per model and mode.
"""

import json
import os

import pytest
import torch

from lib import attention, mixers
from lib.engine import SamplingConfig
from lib.engine.hf import HFEngine
from lib.forward import response_log_probs
from lib.models import padded_attention, persistent_buffers, stop_token_ids
from lib.protocol import DataProto
from tests import zoo
from tests.helpers import launch_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = zoo.available()


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def chat_prompts(tok, num: int = 6) -> DataProto:
    """Left-padded chat prompts of different lengths (~100 tokens: longer than the models' windows)."""
    texts = [tok.apply_chat_template([{"role": "user", "content": "1,2,3,4,"[: 2 + i] * (1 + i % 3)}],
                                     tokenize=False, add_generation_prompt=True) for i in range(num)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def build(path: str, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", CASES)
def test_engine_packed_and_padded_log_probs_equal_eager(name, zoo_root):
    from transformers import AutoTokenizer

    path = zoo.build(name, zoo_root)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    eager = build(path, "eager")
    engine = HFEngine(eager.config, torch.device("cpu"), tok.pad_token_id, stop_token_ids(path, tok),
                      SamplingConfig(temperature=1.0, max_new_tokens=12, n=2, seed=3))
    assert dict(engine.aliases) == ({"lm_head.weight": "model.embed_tokens.weight"}
                                    if eager.config.tie_word_embeddings else {})
    engine.wake_up(["weights"])
    # named_parameters lists a tied head once, as the trainer does; the persistent buffers go too, as in a sync
    engine.load_weights([*eager.named_parameters(), *persistent_buffers(eager)])
    engine.finish_sync()
    engine.wake_up(["kv_cache"])
    with torch.no_grad():
        rollout = engine.generate(chat_prompts(tok))
        assert rollout.batch["input_ids"].shape[1] > zoo.WINDOW * 4
        reference, _ = response_log_probs(eager, rollout, packed=False)
        padded, _ = response_log_probs(build(path, padded_attention(eager.config)), rollout, packed=False)
        packed_model = build(path, attention.register())
        mixers.bound(packed_model)  # as lib.models.build_empty does
        packed, _ = response_log_probs(packed_model, rollout, packed=True)
    mask = rollout.batch["response_mask"].bool()
    for what, got in (("engine", rollout.batch["rollout_log_probs"]), ("padded", padded), ("packed", packed)):
        diff = (got - reference)[mask].abs().max().item()
        assert diff < 1e-4, (name, what, diff)


MODES = {  # name: train_grpo flags
    "fsdp": ["--actor.fsdp.shard_size", "0"],
    "replica": ["--actor.fsdp.shard_size", "1"],
    "sp2": ["--actor.fsdp.shard_size", "0", "--trainer.sp_size", "2"],
}
# The models each mode runs beyond FSDP's all. The plain replica differs from FSDP in what to_empty and the broadcast
# do to tied heads and buffers: a tied and an untied head, the persistent buffers (Gemma-4's per-layer scalars and
# per-layer inputs, DeepSeek-V3's router bias), a hybrid's mixers. Ulysses splits heads and gathers whole rows for
# the mixers: every attention feature (sliding window, soft-capping with alternating layers, sinks, multi-head latent
# attention, a wider global head, partial rotary) and every kind of mixer (Gated DeltaNet, short convolutions,
# Mamba-2). Measured with all 21 models (on a loaded machine): replica 105 s, sp2 135 s.
MODE_CASES = {
    "fsdp": None,
    "replica": ["llama", "qwen2_untied", "gemma4", "deepseek_v3", "qwen3_5"],
    "sp2": ["mistral_window", "gemma2", "gpt_oss", "deepseek_v3", "gemma4", "glm4_moe", "qwen3_5", "lfm2", "granite4"],
}


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_zoo_runs_reward_loads_without_torch():
    """Each reward worker of a zoo run (two a rank) loads the file ``zoo.REWARD`` names as lib.rewards does; when it
    was tests/zoo.py, each imported torch (1.75 CPU-s) while its 2-step run waited: 6-8 s a run, 2 s without."""
    import subprocess
    import sys

    code = ("import sys; from lib.rewards import load_custom; score = load_custom(sys.argv[1]); "
            "print(score('zoo', 'abc', '', None), sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, zoo.REWARD], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["0.4", "[]"], out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_grpo_steps_train_the_model_that_samples(mode, zoo_root, tmp_path):
    from transformers import AutoModelForCausalLM

    from lib.export import load_checkpoint

    cases = [c for c in CASES if MODE_CASES[mode] is None or c in MODE_CASES[mode]]
    for name in cases:
        zoo.build(name, zoo_root)
    out = launch_runs(zoo.plan(zoo_root, str(tmp_path), cases, *MODES[mode]), tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    ids = torch.randint(3, zoo.VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    for name in cases:
        run = tmp_path / name
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2], name
        # the engine samples from the model the trainer trains: same log-probs, every step
        diffs = [r["rollout/logp_abs_diff"] for r in rows]
        assert max(diffs) < 1e-4, (name, mode, diffs)
        assert all(r["actor/grad_norm"] > 0 for r in rows), (name, rows)  # the update moved the weights
        # the export is the trained policy: its logits equal those of the checkpoint's weights, loaded untied so
        # that a head trained apart from the embedding would show
        config = AutoModelForCausalLM.from_pretrained(run / "hf_final").config
        state = load_checkpoint(str(run / "checkpoints" / "step_2"), "actor", os.path.join(zoo_root, name))
        if config.tie_word_embeddings:
            assert torch.equal(state.get("lm_head.weight", state["model.embed_tokens.weight"]),
                               state["model.embed_tokens.weight"]), name
        config.tie_word_embeddings = False
        trained = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        trained.load_state_dict({"lm_head.weight": state["model.embed_tokens.weight"], **state}, strict=True)
        exported = AutoModelForCausalLM.from_pretrained(run / "hf_final", dtype=torch.float32)
        # the weights that are not parameters come back as the user's checkpoint holds them (off their init values:
        # zoo.move_off_init), in the checkpoint and in the export
        given = AutoModelForCausalLM.from_pretrained(os.path.join(zoo_root, name), dtype=torch.float32)
        for buffer, value in persistent_buffers(given):
            assert torch.equal(state[buffer], value), (name, mode, buffer)
            assert torch.equal(exported.get_buffer(buffer), value), (name, mode, buffer)
        diff = (logits_of(trained.eval(), ids) - logits_of(exported.eval(), ids)).abs().max().item()
        assert diff < 1e-5, (name, mode, diff)


def test_the_engine_stops_where_generate_stops(zoo_root, tmp_path):
    """Both engines stop on the tokenizer's eos and every eos id of generation_config.json, as transformers'
    generate does. Here the generation config lists the token the model writes first for one prompt: that row
    ends after one token. Before, the HF engine stopped on the tokenizer's eos only and ran to the length cap."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    path = str(tmp_path / "model")
    shutil.copytree(zoo.build("qwen2_tied", zoo_root), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = build(path, "sdpa")
    prompts = chat_prompts(tok, 4)
    b = prompts.batch
    with torch.no_grad():
        first = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                      position_ids=b["position_ids"]).logits[0, -1].argmax().item()
    GenerationConfig(eos_token_id=[tok.eos_token_id, first], pad_token_id=tok.pad_token_id).save_pretrained(path)
    stops = stop_token_ids(path, tok)
    assert stops == sorted({tok.eos_token_id, first})
    engine = HFEngine(model.config, torch.device("cpu"), tok.pad_token_id, stops,
                      SamplingConfig(temperature=0.0, max_new_tokens=16))
    engine.wake_up()
    engine.load_weights(model.named_parameters())
    out = engine.generate(prompts)
    lengths = out.batch["response_mask"].sum(-1).long().tolist()
    assert lengths[0] == 1 and out.batch["responses"][0, 0].item() == first
    with torch.no_grad():
        ref = model.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"], do_sample=False,
                             max_new_tokens=16, generation_config=GenerationConfig.from_pretrained(path))
    for i, n in enumerate(lengths):  # the same tokens, ending at the same place
        expected = ref[i, b["input_ids"].shape[1]:].tolist()
        cut = next((j + 1 for j, t in enumerate(expected) if t in stops), len(expected))
        assert out.batch["responses"][i, :n].tolist() == expected[:cut], i


def test_every_mode_runs_models_of_the_zoo():
    for mode, names in MODE_CASES.items():
        assert mode in MODES and (names is None or set(names) <= set(zoo.CASES)), mode
