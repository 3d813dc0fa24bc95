"""Vision-language RL: the trainer's forward on image prompts equals the model's own (tests/zoo.py VISION cases)."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from lib import attention, mixers
from lib.forward import response_log_probs
from lib.models import load_config, load_tokenizer
from lib.protocol import DataProto
from lib.vision import attn_implementations, rope
from lib.vision.processor import VisionProcessor, with_image_parts
from tests import zoo

CASES = [name for name in zoo.VISION if hasattr(__import__("transformers"), zoo.VISION[name][0])]


@pytest.fixture(scope="module")
def vision_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vision_zoo"))


def square(size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size)
    image.paste(colour, (8, 8, 32, 32))
    return image


ROWS = [  # (prompt text with <image> placeholders, images, response length): 1 and 2 images, different sizes
    ("<image>Which colour is the square?", [square((56, 56), (255, 0, 0))], 7),
    ("Compare <image> with <image>: same colour?", [square((84, 56), (0, 255, 0)), square((56, 112), (0, 0, 255))], 4),
    ("No image here, just text.", [], 5),
]


def micro_batch(path: str, rows: list = ROWS) -> tuple[DataProto, object]:
    """Left-padded prompts + right-padded random responses, with the rows' images and 3-D rope rows."""
    config = load_config(path)
    tok = load_tokenizer(path)
    proc = VisionProcessor(path, config, tok)
    gen = torch.Generator().manual_seed(0)
    prompts, responses, mm = [], [], []
    for text, images, length in rows:
        rendered = tok.apply_chat_template(with_image_parts([{"role": "user", "content": text}]),
                                           add_generation_prompt=True, tokenize=False)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        assert ids.count(proc.image_token_id) == len(images)  # the engine's form: one placeholder per image
        features = proc.images(images) if images else None
        prompts.append(proc.expand(ids, features["image_grid_thw"]) if images else ids)
        responses.append(torch.randint(10, 90, (length,), generator=gen).tolist())
        mm.append(features)
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(rows), P + R), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p):P], mask[b, P - len(p):P + len(r)] = torch.tensor(p), 1
        ids[b, P:P + len(r)] = torch.tensor(r)
    grids = [f["image_grid_thw"] if f else torch.zeros(0, 3, dtype=torch.long) for f in mm]
    rope_rows = torch.stack([rope.row_positions(ids[b], mask[b], P, proc.image_token_id, grids[b], proc.merge)
                             for b in range(len(rows))])
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
             "responses": ids[:, P:], "response_mask": mask[:, P:], "rope_position_ids": rope_rows}
    return DataProto.from_dict(batch, {"multi_modal": np.array(mm + [None], dtype=object)[:-1]}), proc


@pytest.mark.parametrize("name", CASES)
def test_packed_and_padded_equal_the_models_own_forward(name, vision_root):
    path = zoo.build_vision(name, vision_root)
    micro, proc = micro_batch(path)
    b = micro.batch
    config = load_config(path)
    own = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    features = {k: torch.cat([f[k] for f in micro.non_tensor_batch["multi_modal"] if f])
                for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        # the model's own: its processor's inputs, its own rope index (from the token types), its own masks
        logits = own(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     mm_token_type_ids=(b["input_ids"] == proc.image_token_id).int(), **features).logits
        hf_rope, _ = own.model.get_rope_index(b["input_ids"], (b["input_ids"] == proc.image_token_id).int(),
                                              features["image_grid_thw"], attention_mask=b["attention_mask"])
        assert torch.equal(hf_rope.transpose(0, 1) * b["attention_mask"][:, None], b["rope_position_ids"])
        R = b["responses"].shape[1]
        reference = torch.log_softmax(logits[:, -R - 1:-1].float(), -1).gather(-1, b["responses"][..., None])[..., 0]
        reference = reference * b["response_mask"]
        padded_model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementations(config, "sdpa")).eval()
        padded, _ = response_log_probs(padded_model, micro, packed=False)
        packed_model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementations(config, attention.register())).eval()
        mixers.bound(packed_model)
        packed, _ = response_log_probs(packed_model, micro, packed=True)
    for what, got in (("padded", padded), ("packed", packed)):
        diff = (got - reference).abs().max().item()
        assert diff < 1e-5, (name, what, diff)


@pytest.mark.parametrize("name", CASES[:1])
def test_the_image_changes_the_log_probs(name, vision_root):
    """The same prompt text and response with another image gives other log-probs (a dropped image would not)."""
    path = zoo.build_vision(name, vision_root)
    config = load_config(path)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementations(config, attention.register())).eval()
    red, green = [[("<image>Which colour?", [square((56, 56), colour)], 6)] for colour in ((255, 0, 0), (0, 255, 0))]
    with torch.no_grad():
        (a, _), (b, _) = (response_log_probs(model, micro_batch(path, rows)[0], packed=True) for rows in (red, green))
    assert (a - b).abs().max().item() > 1e-3
