"""TRL's side of bench/compare_trl.py: GRPOTrainer on the toy task, run with torchrun in the throw-away TRL
environment that script makes. Writes OUT/timings.json (per optimizer step: wall time, generation time, reward)
and the final model to OUT/model.

    torchrun --nproc-per-node 2 bench/trl_side.py MODEL TRAIN_JSONL OUT SEED STEPS [PROMPTS MINI MAX_NEW LR]
    python bench/trl_side.py objective START MOVED TRAIN_JSONL BATCH OUT
    torchrun --nproc-per-node 1 bench/trl_side.py colocate MODEL TRAIN_JSONL OUT STEPS PROMPTS N MAX_NEW DEVICE

The second form evaluates TRL's loss on one given batch (bench/compare_trl.py --objective) and saves its
advantages, per-token log-probs, per-token loss, loss and gradient to OUT. The third is the GPU acceptance run's
speed anchor (bench/gpu_acceptance.py check_trl): colocated vLLM with sleep mode on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

if sys.argv[1:2] != ["colocate"] or sys.argv[-1] != "cuda":  # the colocate form on a GPU uses it
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.rewards.builtin import toy  # noqa: E402


GROUP = 8  # samples per prompt


def toy_reward(completions, reward_model, **_):
    """The toy task's score, from our own scorer (lib.rewards does not import torch or anything TRL lacks)."""
    return [toy(c[0]["content"] if isinstance(c, list) else c, rm["ground_truth"])["score"]
            for c, rm in zip(completions, reward_model)]


def timed(trainer_class, log: list[dict]):
    """``trainer_class`` with each generation's seconds appended to ``log`` (TRL's generation and scoring)."""
    class Timed(trainer_class):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            log.append({"generate_s": time.perf_counter() - t0})
            return result

    return Timed


def main(model_path: str, train: str, out: str, seed: int, steps: int, prompts: int = 64, mini: int = 128,
         max_new: int = 10, lr: float = 1e-3) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = prompts * GROUP  # per RL step; optimizer steps of `mini` samples
    config = GRPOConfig(
        output_dir=out, use_cpu=True, seed=seed, report_to=[], save_strategy="no", logging_steps=samples // mini,
        per_device_train_batch_size=mini // world, steps_per_generation=samples // mini, gradient_accumulation_steps=1,
        num_generations=GROUP, max_completion_length=max_new, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=0.0, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", max_steps=steps * samples // mini, bf16=False,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    data = load_dataset("json", data_files=train, split="train")
    log: list[dict] = []

    Timed = timed(GRPOTrainer, log)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            log.append({"step": state.global_step, "step_s": now - self.t0})
            self.t0 = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                log.append({"step": state.global_step, "reward": logs["reward"], "num_tokens": logs["num_tokens"],
                            "logs": logs})

    trainer = Timed(model=model, args=config, train_dataset=data, processing_class=tokenizer, reward_funcs=toy_reward,
                    callbacks=[StepClock()])
    trainer.train()
    if trainer.accelerator.is_main_process:
        trainer.save_model(os.path.join(out, "model"))
        tokenizer.save_pretrained(os.path.join(out, "model"))
        with open(os.path.join(out, "timings.json"), "w") as f:
            json.dump(log, f)


def objective(start: str, moved: str, train: str, batch_path: str, out: str) -> None:
    """TRL's own loss (GRPOTrainer._compute_loss, "dapo" = token-mean) on the given batch: old log-probs under
    the start weights, the loss and its gradient under the moved weights. The per-token loss is read as the
    derivative of the loss with respect to a per-token mask of ones (TRL multiplies its mask by ``tool_mask``)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    b = torch.load(batch_path)
    rows = len(b["rewards"])
    config = GRPOConfig(output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=rows,
                        steps_per_generation=1, gradient_accumulation_steps=1, num_generations=GROUP,
                        max_completion_length=b["completion_ids"].shape[1], beta=0.0, epsilon=0.2, loss_type="dapo",
                        scale_rewards="group", bf16=False, disable_tqdm=True)
    tok = AutoTokenizer.from_pretrained(moved)
    model = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, args=config, processing_class=tok, reward_funcs=toy_reward,
                          train_dataset=load_dataset("json", data_files=train, split="train"))
    start_model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    add_fused_lm_head(start_model, temperature=1.0, outputs=("log_probs", "entropy"))  # as TRL patches its own
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    width = b["completion_ids"].shape[1]
    with torch.no_grad():
        old = trainer._get_per_token_logps_and_entropies(start_model, ids, attn, width, batch_size=rows)[0]
        now = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, width, batch_size=rows)[0]
    # TRL's group advantages (GRPOTrainer._generate_and_score_completions with scale_rewards="group")
    grouped = b["rewards"].view(-1, GROUP)
    mean, std = grouped.mean(1).repeat_interleave(GROUP), grouped.std(1).repeat_interleave(GROUP)
    advantages = (b["rewards"] - mean) / (std + 1e-4)
    ones = torch.ones(b["completion_mask"].shape, requires_grad=True)
    num_items = b["completion_mask"].sum()
    inputs = {"prompt_ids": b["prompt_ids"], "prompt_mask": b["prompt_mask"], "completion_ids": b["completion_ids"],
              "completion_mask": b["completion_mask"], "advantages": advantages, "old_per_token_logps": old,
              "num_items_in_batch": num_items, "tool_mask": ones}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which this check does not run
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    torch.save({"loss": loss.detach(), "per_token_loss": ones.grad * num_items, "advantages": advantages,
                "logp_start": old, "logp_moved": now, "mask": b["completion_mask"],
                "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}},
               os.path.join(out, "objective.pt"))


def colocate(model_path: str, train: str, out: str, steps: int, prompts: int, n: int, max_new: int,
             device: str) -> None:
    """TRL's GRPOTrainer in the acceptance run's GRPO configuration (bench/gpu_acceptance.py check_trl; our side is
    configs/qwen2.5_0.5b_gsm8k_grpo.yaml at its sizes): ``prompts`` x ``n`` samples of up to ``max_new`` tokens a
    step, one optimizer step a step, lr 1e-6, the k3 KL at 0.001 against a reference model, token-mean loss,
    gradient checkpointing. On CUDA vLLM colocated in the process with sleep mode and bf16 autocast over fp32
    weights (ours: an FSDP bf16 compute policy over fp32 masters); on CPU transformers' generate, fp32. Writes
    OUT/timings.json: per step its seconds, the generation's seconds and TRL's cumulative token count."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gpu = device == "cuda"
    samples = prompts * n
    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.3,
                  vllm_max_model_length=64 + max_new, bf16=True) if gpu else dict(use_cpu=True, bf16=False)
    config = GRPOConfig(
        output_dir=out, seed=1, report_to=[], save_strategy="no", logging_steps=1, per_device_train_batch_size=samples,
        steps_per_generation=1, gradient_accumulation_steps=1, num_generations=n, max_completion_length=max_new,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-6, weight_decay=0.0, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, beta=0.001, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group", max_steps=steps, gradient_checkpointing=True, remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True, model_init_kwargs={"dtype": torch.float32}, **engine)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    log: list[dict] = []

    Timed = timed(GRPOTrainer, log)

    def save() -> None:  # after every step: a run stopped by the acceptance run's budget keeps its steps
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(out, "timings.json.part"), "w") as f:
                json.dump(log, f)
            os.replace(os.path.join(out, "timings.json.part"), os.path.join(out, "timings.json"))

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            log.append({"step": state.global_step, "step_s": time.perf_counter() - self.t0})
            save()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                log.append({"step": state.global_step, "num_tokens": logs["num_tokens"]})
                save()

    trainer = Timed(model=model_path, args=config, processing_class=tokenizer, reward_funcs=toy_reward,
                    train_dataset=load_dataset("json", data_files=train, split="train"), callbacks=[StepClock()])
    trainer.train()
    save()


if __name__ == "__main__" and sys.argv[1] == "colocate":
    colocate(*sys.argv[2:5], *map(int, sys.argv[5:9]), sys.argv[9])
elif __name__ == "__main__" and sys.argv[1] == "objective":
    objective(*sys.argv[2:7])
elif __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:9]), *map(float, sys.argv[9:]))
