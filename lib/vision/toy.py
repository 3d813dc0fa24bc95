"""The embedded visual task (``toy_vision``): which colour is the square? The image is the only signal.

Each image is black, 56 x 56 pixels, with one red, green or blue square at a random place and size; the prompt text
is the same on every row ("<image>Colour?"), and the answer is the colour's name, scored by the toy task's prefix
rule (lib/rewards/builtin.py, data_source ``toy``). The policy is a tiny model of Qwen2-VL's architecture (a 1-block
vision tower, patches of 14 merged 2 x 2: four image tokens per image; a 2-layer language model) with a
character-level tokenizer, warm-started for a few seconds on prompts whose answers are drawn at random: it learns
to answer with a colour name, right about a third of the time; RL must learn to read the image. The data is
parquet in verl's geo3k layout (an ``images`` column of PNG bytes), read through ``datasets`` like a user's.
Built offline, deterministically, under ``<dir>`` (default ``runs/toy_vision_assets``).
"""

from __future__ import annotations

import io
import os
import random

import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lib.toy import build_once, fit

COLOURS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (40, 80, 255)}
PROMPT = "<image>Colour?"
SPECIAL = ["<pad>", "<eos>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
CHARS = list(" ?abcdefghijklmnopqrstuvwxyzC")
# an image part renders as the model's placeholder between its vision bounds (as Qwen2-VL's template does)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")
SIZE, PATCH, MERGE = 56, 14, 2


def image(colour: str, rng: random.Random) -> Image.Image:
    """A black image with one square of ``colour``, its side 24 to 40 pixels, anywhere inside."""
    side = rng.randint(24, 40)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    img = Image.new("RGB", (SIZE, SIZE))
    img.paste(COLOURS[colour], (x, y, x + side, y + side))
    return img


def png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def rows(num: int, seed: int) -> list[dict]:
    """geo3k-layout rows: chat prompt with the placeholder, an images column of {bytes, path}, the colour as truth."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        colour = rng.choice(sorted(COLOURS))
        out.append({"prompt": [{"role": "user", "content": PROMPT}],
                    "images": [{"bytes": png(image(colour, rng)), "path": None}], "data_source": "toy",
                    "reward_model": {"ground_truth": colour, "style": "rule"}, "extra_info": {"index": i}})
    return out


def build_tokenizer(path: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   additional_special_tokens=SPECIAL[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


ARCHS = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
         "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)}
VISION_TOWERS = {  # arch: the tower's config for ``heads`` heads (of 32)
    "qwen2_vl": lambda heads: dict(depth=1, embed_dim=32, hidden_size=64, num_heads=heads, mlp_ratio=2,
                                   patch_size=PATCH, spatial_merge_size=MERGE),
    # windows of 2x2 merged patches (a 56-pixel image is 2x2 of them), the second block attending the whole image
    "qwen2_5_vl": lambda heads: dict(depth=2, hidden_size=32 * heads, intermediate_size=64, num_heads=heads,
                                     out_hidden_size=64, patch_size=PATCH, spatial_merge_size=MERGE,
                                     window_size=2 * PATCH * MERGE, fullatt_block_indexes=[1]),
}


def build_policy(tokenizer: PreTrainedTokenizerFast, seed: int, heads: int = 4, kv_heads: int = 2,
                 vision_heads: int = 2, arch: str = "qwen2_vl"
                 ) -> Qwen2VLForConditionalGeneration | Qwen2_5_VLForConditionalGeneration:
    """The policy, random. Head sizes are 64 / ``heads`` in the language model, 32 / ``vision_heads`` in the tower
    (vLLM's attention kernels take 32 and up: 2, 1 and 1); the 3-D rope splits each head's frequencies 1 : 1.5 : 1.5
    over time, height and width. ``arch`` "qwen2_5_vl": Qwen2.5-VL's layout instead (an RMS-normed, gated tower of
    windowed attention with one full-attention block, a merger to the language model's width)."""
    torch.manual_seed(seed)
    half = 64 // heads // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    config_class, model_class = ARCHS[arch]
    config = config_class(
        text_config=dict(vocab_size=len(SPECIAL) + len(CHARS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=section),
                         tie_word_embeddings=True, pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"],
                         bos_token_id=None),
        vision_config=VISION_TOWERS[arch](vision_heads),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=None)
    model = model_class(config)
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.eos_token_id = ids["<eos>"]
    model.generation_config.bos_token_id = None
    return model


def warm_start(model, tokenizer, processor, train: list[dict], steps: int, seed: int) -> None:
    """Supervised steps on prompt + a colour name drawn at random (not the image's) + eos: the format, not the task."""
    rng = random.Random(seed + 1)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "Colour?"}]}],
                                           tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    image_id = model.config.image_token_id
    pixels = processor(images=[Image.open(io.BytesIO(train[0]["images"][0]["bytes"]))], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    expanded = [t for i in ids for t in ([i] * int(grid.prod() // MERGE ** 2) if i == image_id else [i])]
    examples = []
    for _ in range(len(train)):
        answer = tokenizer(rng.choice(sorted(COLOURS)), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((expanded + answer, [-100] * len(expanded) + answer))

    def extra(batch_rows: int) -> dict:  # any image will do: the answers do not depend on it
        return {"pixel_values": pixels["pixel_values"].repeat(batch_rows, 1),
                "image_grid_thw": grid.repeat(batch_rows, 1)}

    fit(model, examples, steps, seed, tokenizer.pad_token_id, extra=extra, image_token_id=image_id)


def prepare(path: str = "runs/toy_vision_assets", seed: int = 0, warm_steps: int = 40,
            num_train: int = 512, num_val: int = 48) -> dict[str, str]:
    """Build (once) the model folder (weights, tokenizer, image processor) and the train / validation parquet
    files; returns their paths."""
    def build(tmp: str) -> None:
        model_dir = os.path.join(tmp, "model")
        tokenizer = build_tokenizer(model_dir)
        processor = Qwen2VLImageProcessorPil(min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE, patch_size=PATCH,
                                             merge_size=MERGE, temporal_patch_size=2)
        processor.save_pretrained(model_dir)
        train, val = rows(num_train, seed), rows(num_val, seed + 1000)
        import datasets  # here: ~0.5 s to import, and every run imports this module

        datasets.disable_progress_bars()
        datasets.Dataset.from_list(train).to_parquet(os.path.join(tmp, "data", "train.parquet"))
        datasets.Dataset.from_list(val).to_parquet(os.path.join(tmp, "data", "val.parquet"))
        model = build_policy(tokenizer, seed)
        warm_start(model, tokenizer, processor, train, warm_steps, seed)
        model.save_pretrained(model_dir)

    return build_once(path, build, "parquet")
