"""Hugging Face folders from training state: safetensors in the model's own dtype (sharded when large), its
config (custom code copied when it has any), generation_config.json, and the tokenizer as the model ships it.

    python -m lib.export CKPT_DIR OUT_DIR [--part actor|critic] [--merge] [--max-shard-size 5GB]

CKPT_DIR is a checkpoint (``runs/<run>/checkpoints/step_<k>``) or a run folder (its latest checkpoint); the run's
config.yaml says which model it trained. The end-of-run export (``hf_final/``) writes through the same function.
A LoRA run (actor.lora) exports its adapter as a PEFT folder (``PeftModel.from_pretrained(base, OUT_DIR)``), or with
``--merge`` the base with the adapter merged in fp32 (W + s*BA), as a Hugging Face folder in the base's dtype.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoTokenizer, GenerationConfig

from lib import lora, models
from lib.config import LoraConfig
from lib.dist import Topology
from lib.fsdp import full_state_dict_on_rank0
from lib.runfolder import latest_step, step_dir
from lib.vision import is_vision_param

KIND = {"actor": "causal_lm", "critic": "critic"}


def write_hf(state: dict[str, torch.Tensor], model_path: str, out_dir: str, kind: str = "causal_lm",
             trust_remote_code: bool = False, max_shard_size: str = "5GB") -> None:
    """Write full weights ``state`` (HF names) as a folder ``from_pretrained`` and vLLM load, in the dtype of the
    model at ``model_path``."""
    config = models.load_config(model_path, trust_remote_code)
    dtype = models.saved_dtype(config)
    model = models.build_empty(config, kind, models.padded_attention(config), trust_remote_code)
    apart = [a for a, t in models.tied_aliases(model).items()
             if a in state and t in state and not torch.equal(state[a], state[t])]
    if apart:
        # a head trained apart from the embedding (a checkpoint from before the trainer kept the tie): tying them
        # again would throw the trained head away, so the export is untied and holds both
        print(f"warning: the weights hold {apart} apart from what the model ties them to; {out_dir} is written "
              f"with tie_word_embeddings false", file=sys.stderr)
        config.tie_word_embeddings = False
        model = models.build_empty(config, kind, models.padded_attention(config), trust_remote_code)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in [*model.named_parameters(), *models.persistent_buffers(model)] if p.is_meta]
    if missing:
        raise ValueError(f"the weights lack {missing[:5]}: not a checkpoint of this model ({model_path})")
    model.config.dtype = dtype
    if kind in ("causal_lm", "vision_lm"):
        try:
            model.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # the model ships none: the one its config implies
            model.generation_config = GenerationConfig.from_model_config(config)
    os.makedirs(out_dir, exist_ok=True)
    if kind == "vision_lm":  # trained whole, with its images: written whole, with its image processor
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
        copy_processor_files(model_path, out_dir)
    elif whole_class(config) is None:
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    else:
        write_whole(model, config, model_path, out_dir, trust_remote_code, max_shard_size)
    # as the model ships it: not the trainer's runtime settings (left padding, pad = eos)
    AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(out_dir)


def whole_class(config: Any) -> str | None:
    """The class a checkpoint ships as when it holds more than the language model the trainer trains (the
    vision-language classes of Qwen3.5 and Gemma-4: a vision tower beside it), else None."""
    if config.get_text_config() is config:
        return None
    return (getattr(config, "architectures", None) or [None])[0]


def whole_names(language_model: nn.Module, whole: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The language model's state names -> the names of the same tensors in the whole model: its decoder sits under
    another prefix there (``model.language_model.`` for Qwen3.5 and Gemma-4), the head keeps its name."""
    decoder = whole.get_decoder()
    prefix = next(name for name, module in whole.named_modules() if module is decoder)
    ours = language_model.get_decoder()
    our_prefix = next(name for name, module in language_model.named_modules() if module is ours)
    names, unknown = {}, []
    for name in language_model.state_dict():
        mapped = prefix + name[len(our_prefix):] if name.startswith(our_prefix + ".") else name
        if mapped in state:
            names[name] = mapped
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"the trained language model's weights {unknown[:3]} have no place in {type(whole).__name__}")
    return names


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def write_whole(language_model: nn.Module, config: Any, model_path: str, out_dir: str, trust_remote_code: bool,
                max_shard_size: str) -> None:
    """A whole checkpoint trained text-only, written as the class it came as: the checkpoint's own weights (the
    vision tower bit for bit, in their stored dtypes) with the trained language model put in their place, under
    the names transformers gives the language model in that layout, and the processor files as shipped."""
    cls = whole_class(config)
    if not hasattr(transformers, cls):
        raise ValueError(f"{model_path} is a {cls} checkpoint, a class this transformers lacks: upgrade transformers "
                         f"to export it whole")
    whole = getattr(transformers, cls).from_pretrained(model_path, dtype="auto", trust_remote_code=trust_remote_code)
    state = whole.state_dict()
    names = whole_names(language_model, whole, state)
    with torch.no_grad():
        for name, tensor in language_model.state_dict().items():
            state[names[name]].copy_(tensor)
    whole.save_pretrained(out_dir, max_shard_size=max_shard_size)
    copy_processor_files(model_path, out_dir)


def copy_processor_files(model_path: str, out_dir: str) -> None:
    """The image processor and chat template files as the model ships them."""
    for file in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(model_path, file)):
            shutil.copy(os.path.join(model_path, file), os.path.join(out_dir, file))


def checkpoint_kind(ckpt_dir: str, part: str) -> str:
    """The model kind a checkpoint's part was trained as: a vision-language policy trained with its images holds
    its vision tower, or, with LoRA (the adapter alone is saved), adapters under the vision-language class's
    ``model.language_model.`` (lib.models.KINDS)."""
    prefix = f"{part}.model."
    names = [n[len(prefix):] for n in dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
             if n.startswith(prefix)]
    if any(is_vision_param(name) or name.startswith("model.language_model.") for name in names):
        return "vision_lm"
    return KIND[part]


def load_checkpoint(ckpt_dir: str, part: str, model_path: str, trust_remote_code: bool = False,
                    lora_config: Any = None) -> dict[str, Any]:
    """One part's full weights from a DCP checkpoint, read in this process (no process group). ``lora_config`` (a
    PEFT LoraConfig): the checkpoint holds an adapter; its tensors are returned under PEFT's names."""
    config = models.load_config(model_path, trust_remote_code)
    model = models.build_empty(config, checkpoint_kind(ckpt_dir, part), models.padded_attention(config),
                               trust_remote_code)
    options = None
    if lora_config is not None:
        lora.inject(model, lora_config)
        options = StateDictOptions(ignore_frozen_params=True)
    model.to_empty(device="cpu")
    state = {f"{part}.model": get_model_state_dict(model, options=options)}  # the names the trainer saved under
    dcp.load(state, checkpoint_id=ckpt_dir, no_dist=True)
    if lora_config is not None:
        return {lora.peft_name(n): t for n, t in state[f"{part}.model"].items()}
    return state[f"{part}.model"]


def merged_state(model_path: str, lora_config: Any, adapter: dict[str, torch.Tensor],
                 trust_remote_code: bool = False, kind: str = "causal_lm") -> dict[str, torch.Tensor]:
    """The base at ``model_path`` with ``adapter`` (PEFT names) merged: W + s*BA in fp32 (lib.lora.iter_merged)."""
    config = models.load_config(model_path, trust_remote_code)
    full = models.load_full(model_path, kind, models.padded_attention(config), trust_remote_code)
    lora.inject(full, lora_config)
    lora.set_adapter(full, adapter)
    return dict(lora.iter_merged(full))


def export_hf(model: nn.Module, model_path: str, out_dir: str, topo: Topology, trust_remote_code: bool = False,
              kind: str = "causal_lm") -> None:
    """The trained weights as a Hugging Face folder (``write_hf``) at the end of a run, gathered one tensor at a
    time on every rank and written by rank 0."""
    full = full_state_dict_on_rank0(model, topo)
    if topo.is_main:
        write_hf(full, model_path, out_dir, kind, trust_remote_code)
    dist.barrier()

def export_adapter(model: nn.Module, lora_cfg: Any, model_path: str, out_dir: str, topo: Topology) -> None:
    """A LoRA policy's adapter as a PEFT folder (``PeftModel.from_pretrained(base, out_dir)``), gathered on every
    rank and written by rank 0."""
    tensors = {name: t.cpu() for name, t in lora.iter_adapter(model)}
    if topo.is_main:
        vision = any(is_vision_param(name) for name, _ in model.named_parameters())
        lora.save_adapter(out_dir, tensors, lora.peft_config(lora_cfg), model_path, vision)
    dist.barrier()


def checkpoint_dir(path: str) -> str:
    """A checkpoint folder, or a run folder's latest one."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    step = latest_step(path)
    if step is None:
        raise ValueError(f"{path} is neither a checkpoint (runs/<run>/checkpoints/step_<k>) nor a run folder with one")
    return step_dir(path, step)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m lib.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--part", choices=sorted(KIND), default="actor")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--merge", action="store_true",
                   help="LoRA runs: write the base with the adapter merged (in fp32), not the adapter")
    args = p.parse_args(argv)
    try:
        ckpt = checkpoint_dir(os.path.abspath(args.checkpoint))
        run = os.path.dirname(os.path.dirname(ckpt))
        with open(os.path.join(run, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        model_cfg = cfg["actor"]["model"]
        if args.part == "critic" and cfg["critic"]["model"]["path"]:
            model_cfg = cfg["critic"]["model"]
        trust = bool(model_cfg.get("trust_remote_code"))
        lora_cfg = LoraConfig(**cfg["actor"].get("lora", {})) if args.part == "actor" else None
        if lora_cfg is not None and lora.enabled(lora_cfg):
            pc = lora.peft_config(lora_cfg)
            adapter = load_checkpoint(ckpt, args.part, model_cfg["path"], trust, pc)
            kind = checkpoint_kind(ckpt, args.part)
            if args.merge:
                write_hf(merged_state(model_cfg["path"], pc, adapter, trust, kind), model_cfg["path"], args.out_dir,
                         kind, trust, args.max_shard_size)
            else:
                lora.save_adapter(args.out_dir, adapter, pc, model_cfg["path"], kind == "vision_lm")
        elif args.merge:
            raise ValueError(f"--merge: the run at {run} trained no LoRA adapter (actor.lora is off); leave --merge out")
        else:
            state = load_checkpoint(ckpt, args.part, model_cfg["path"], trust)
            write_hf(state, model_cfg["path"], args.out_dir, checkpoint_kind(ckpt, args.part), trust,
                     args.max_shard_size)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {type(e).__name__ + ': ' if isinstance(e, KeyError) else ''}{e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} from {ckpt} ({args.part})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
