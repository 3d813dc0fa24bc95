"""The samples every step keeps (lib/samples): what the step trained on, the same groups whatever the ranks, capped,
off, from both scripts."""

import json
import os

import pytest
import torch

from lib.samples import chosen, store
from lib.view import read

ALL = ("--samples.share", "1", "--samples.max_rows", "100000")


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory, shared_assets_dir):
    """One launch of 2 CPU ranks on the default task, 2 steps each: every sample kept (as is, and with Ulysses SP 2
    over both ranks), the default share capped at 16 rows, none kept, and PPO's script keeping every sample."""
    from lib import toy
    from tests.conftest import shared_assets
    from tests.helpers import launch_runs

    root = tmp_path_factory.mktemp("samples")
    digits = toy.prepare(str(shared_assets(shared_assets_dir, "toy_assets")))
    base = ["--actor.model.path", digits["model"], "--data.train_files", digits["train"], "--trainer.output_root",
            str(root), "--trainer.total_steps", "2", "--trainer.val_every", "0", "--trainer.log_samples", "0",
            "--actor.mini_batch_size", "512"]  # one mini-batch: the canary is a token mean over the step
    plan = [(name, script, [*base, "--trainer.run_name", name, *args]) for name, script, args in (
        ("all", "train_grpo.py", ALL),
        ("sp2", "train_grpo.py", (*ALL, "--trainer.sp_size", "2", "--actor.fsdp.shard_size", "0")),
        ("capped", "train_grpo.py", ("--samples.max_rows", "16")),
        ("off", "train_grpo.py", ("--samples.share", "0")),
        ("ppo", "train_ppo.py", (*ALL, "--algorithm.critic_warmup", "0")))]
    launched = launch_runs(plan, root)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-5000:]
    return root


def _kept(root, name):
    return {step: store.read_step(path) for step, path in store.steps(str(root / name)).items()}


def _metrics(root, name):
    return [json.loads(line) for line in open(root / name / "metrics.jsonl")]


@pytest.mark.parametrize("name", ["all", "sp2", "ppo"])
def test_the_samples_kept_are_what_the_step_trained_on(sample_runs, name):
    """Every sample of each step (512: 64 prompts x 8, PPO's 128 x 4; whole groups; one mini-batch): the rewards' and lengths' means are the step's
    reward/mean and response/length_mean, the mean |engine - trainer| log-prob over the loss's tokens is the step's
    canary (rollout/logp_abs_diff: one mini-batch, so a token mean), GRPO's advantages recomputed from the kept rewards
    are the kept advantages, and every sampled token has the trainer's log-prob and entropy (recorded by the update:
    with SP, each rank its own rows of the group it trains with)."""
    from lib import algos

    kept, metrics = _kept(sample_runs, name), _metrics(sample_runs, name)
    assert sorted(kept) == [1, 2]
    for step, rows in kept.items():
        m = metrics[step - 1]
        assert m["step"] == step and len(rows) == 512
        groups = {}
        for r in rows:
            groups.setdefault(r["uid"], []).append(r)
        n = 8 if name != "ppo" else 4  # train_ppo.py's samples a prompt
        assert len(groups) == 512 // n and all(sorted(r["sample"] for r in g) == list(range(n)) for g in groups.values())
        assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(m["reward/mean"], rel=1e-6)
        assert sum(r["length"] for r in rows) / len(rows) == m["response/length_mean"]
        diffs = [abs(e - t) for r in rows for e, t, keep in zip(r["engine_logp"], r["trainer_logp"], r["loss_mask"])
                 if keep]
        assert sum(diffs) / len(diffs) == pytest.approx(m["rollout/logp_abs_diff"], rel=1e-5, abs=1e-12)
        for r in rows:
            assert len(r["response_ids"]) == len(r["entropy"]) == len(r["advantages"]) == r["response_tokens"]
            assert all(e > 0 for e, s in zip(r["entropy"], r["sampled_mask"]) if s)
            assert r["finish"] in ("stop", "length") and r["prompt"] and r["turns"] is None
            assert set(json.loads(r["reward_terms"])) == {"acc"}  # the toy task's rule's term
        if name != "ppo":  # GAE's advantages come from the critic's values
            width = max(r["response_tokens"] for r in rows)
            rewards, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
            for i, r in enumerate(rows):
                mask[i, :r["response_tokens"]] = torch.tensor(r["loss_mask"], dtype=torch.float32)
                last = max(k for k, keep in enumerate(r["loss_mask"]) if keep)
                rewards[i, last] = r["reward"]
            uids = [r["uid"] for r in rows]
            import numpy as np

            adv, _ = algos.grpo(rewards, mask, np.array(uids, dtype=object))
            for i, r in enumerate(rows):
                got = torch.tensor(r["advantages"]) * mask[i, :r["response_tokens"]]
                assert torch.allclose(got, adv[i, :r["response_tokens"]], atol=1e-6), (i, got, adv[i])
                assert r["advantage"] == pytest.approx(float(adv[i][mask[i] > 0].mean()), abs=1e-6)


def test_the_groups_kept_are_chosen_by_their_uid_and_capped(sample_runs):
    """The default share keeps the groups whose uid hashes below it, in the hash's order while 16 rows fit: the same
    groups the run that keeps everything had (same data, same uids); a share of 0 writes nothing."""
    capped, everything = _kept(sample_runs, "capped"), _kept(sample_runs, "all")
    for step, rows in capped.items():
        uids = [r["uid"] for r in everything[step]]
        import zlib

        want = sorted({u for u in uids if chosen(u, 0.125)}, key=lambda u: (zlib.crc32(u.encode()), u))[:2]
        assert list(dict.fromkeys(r["uid"] for r in rows)) == want and len(rows) == 8 * len(want)
    assert not os.path.exists(sample_runs / "off" / "samples")
    assert _metrics(sample_runs, "off")[-1]["step"] == 2


def test_the_run_keeps_its_tokenizer_beside_its_samples(sample_runs):
    """samples/tokenizer: the policy's tokenizer, with which the viewer reads a copied run's tokens: it gives back the
    kept prompts' ids from their text and the responses' text from their ids."""
    tok = read.tokenizer(str(sample_runs / "all"))
    assert os.path.isdir(sample_runs / "all" / "samples" / "tokenizer")
    for r in _kept(sample_runs, "all")[2][:16]:
        assert tok(r["prompt"], add_special_tokens=False)["input_ids"] == r["prompt_ids"]
        assert tok.decode(r["response_ids"], skip_special_tokens=True) == r["response"]


def test_the_samples_settings_are_run_control(tmp_path):
    """What a run keeps of its samples is how it reports, not what it computes: a resume may change it, and the
    default run folder's name does not depend on it (the same name as before the samples existed, so a job requeued
    across the upgrade resumes its run)."""
    from lib.config import parse, to_dict
    from lib.runfolder import check_run_folder, default_run_name

    base, other = (to_dict(parse(["--config", "tiny_cpu_grpo", *args])) for args in
                   ([], ["--samples.share", "0.5", "--samples.max_rows", "8"]))
    base_flat = {k: v for k, v in base.items() if k != "samples"}
    assert default_run_name(base, "train_grpo.py") == default_run_name(other, "train_grpo.py") \
        == default_run_name(base_flat, "train_grpo.py") == "train_grpo-d19a4981"
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump(base))
    check_run_folder(str(run), other, resume=True)  # no refusal
