"""Paths a real run takes beyond the GRPO toy default, end to end through torchrun on 2 gloo ranks: validation
sets of every shape, PPO's options. The small runs of RUNS share one launch (tests/runs_driver.py: the ranks start
once for all of them)."""

import json
import os

import pytest

from tests.conftest import link_assets
from tests.helpers import launch_runs, run_outputs
from tests.test_e2e import ROOT

ONE_STEP = ("--trainer.total_steps", "1", "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "128",
            "--trainer.save_every", "0")


def toy_row(digits, source="toy"):
    return {"prompt": [{"role": "user", "content": ",".join(digits) + ","}], "data_source": source,
            "reward_model": {"ground_truth": ",".join(reversed(digits))}}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def metrics(tmp_path, name="run"):
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


ONE_VAL_ROW = [toy_row("1234")]
VAL_OF_TWO_SOURCES = [toy_row("1234"), toy_row("5678"), toy_row("4321", source="gsm8k")]
RUNS = {  # name: train_grpo.py's arguments ({val1}, {val3}: the held-out files above, written by the fixture)
    "no_val": [*ONE_STEP, "--data.val_files"],
    "no_resume": [*ONE_STEP, "--trainer.val_every", "0", "--trainer.no-resume"],
    "few_val": [*ONE_STEP, "--data.val_files", "{val1}"],
    "per_source": [*ONE_STEP, "--data.val_files", "{val3}", "--trainer.total_steps", "2", "--trainer.save_every", "1"],
    "warmup": ["--trainer.total_steps", "3", "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "64",
               "--trainer.val_every", "0", "--trainer.save_every", "0", "--actor.optim.lr", "1e-3",
               "--actor.optim.warmup_steps", "4"],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, shared_assets_dir):
    """The runs of RUNS one after another in one launch of 2 ranks (tests/runs_driver.py), each in its own folder of
    one output root: (the root, each run's printed output). A run that failed fails the launch: every test here
    shows its output."""
    root = tmp_path_factory.mktemp("paths")
    link_assets(shared_assets_dir, ["toy_assets"], str(root))
    files = {"val1": write_rows(root / "val1.jsonl", ONE_VAL_ROW), "val3": write_rows(root / "val3.jsonl",
                                                                                       VAL_OF_TWO_SOURCES)}
    plan = [(name, "train_grpo.py", [a.format(**files) for a in args] + ["--trainer.output_root", str(root),
                                                                         "--trainer.run_name", name])
            for name, args in RUNS.items()]
    out = launch_runs(plan, root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return root, run_outputs(out.stdout)


@pytest.mark.slow
def test_no_validation_files_with_the_default_val_every(launched):
    """It crashed every rank (TypeError: object of type 'NoneType' has no len())."""
    root, said = launched
    assert "no validation: data.val_files is empty" in said["no_val"]
    assert not any(k.startswith("val/") for r in metrics(root, "no_val") for k in r)


@pytest.mark.slow
def test_no_resume_on_a_fresh_run_folder(launched):
    """--trainer.no-resume on a new run: rank 1 used to check the run folder after rank 0 had started writing it, saw
    a run there and exited 2 (rank 0 then died in its next collective); 1 failure in 1 try here before the fix. Every
    rank now checks before rank 0 writes the folder (a collective in lib.startup.start orders it, not timing), so one
    launch checks it: three made the same check three times."""
    assert len(metrics(launched[0], "no_resume")) == 1


@pytest.mark.slow
def test_fewer_validation_rows_than_ranks(launched):
    """One held-out row on two ranks: the HF engine crashed on the empty rank's batch."""
    got = [r for r in metrics(launched[0], "few_val") if "val/mean@1" in r]
    assert [r["step"] for r in got] == [0, 1]
    assert all(r["val/toy/mean@1"] == r["val/mean@1"] for r in got), got


@pytest.mark.slow
def test_validation_is_reported_per_data_source(launched):
    """Also the metrics verl users watch: validation and checkpoint time, prompt lengths, the shortest response,
    advantage and return statistics."""
    got = metrics(launched[0], "per_source")
    for r in (r for r in got if "val/mean@1" in r):
        toy, gsm = r["val/toy/mean@1"], r["val/gsm8k/mean@1"]
        assert abs(r["val/mean@1"] - (2 * toy + gsm) / 3) < 1e-9, r
        assert r["val/gsm8k/maj@N"] == gsm and r["val/toy/best@N"] == toy  # greedy: one sample per prompt
        assert r["timing/validation_s"] > 0
    train = [r for r in got if "actor/lr" in r]
    assert [r["step"] for r in train] == [1, 2] and "timing/save_checkpoint_s" in train[1]
    for r in train:
        assert 0 < r["prompt/length_min"] <= r["prompt/length_mean"] <= r["prompt/length_max"] <= 10, r
        assert r["response/length_min"] <= r["response/length_mean"], r
        assert r["critic/advantages/min"] < 0 < r["critic/advantages/max"], r
        assert r["critic/returns/mean"] == r["critic/advantages/mean"], r  # GRPO: returns are the advantages


@pytest.mark.slow
def test_warmup_counts_training_steps_and_logs_the_rate_used(launched):
    """Two optimizer steps per update: warm-up counts updates (verl's unit), and actor/lr is the rate the update
    used (it was the next update's: 5e-4 and 7.5e-4 here)."""
    assert [r["actor/lr"] for r in metrics(launched[0], "warmup")] == pytest.approx([2.5e-4, 5e-4, 7.5e-4], rel=1e-9)


@pytest.mark.slow
def test_the_same_command_without_a_run_name_resumes(tmp_path):
    """The default run folder was a new timestamp each time: a re-submitted or requeued job started at step 0."""
    import subprocess

    from tests.test_stops import env

    def run(steps):
        return subprocess.run(["bash", "launch.sh", "--trainer.output_root", str(tmp_path), "--trainer.total_steps",
                               str(steps), "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "128",
                               "--trainer.val_every", "0"], cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=900)

    first = run(1)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(2)  # the run is longer now (a run-control setting): the same folder, resumed
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 1" in second.stdout
    folders = sorted(set(os.listdir(tmp_path)) - {"toy_assets"})
    assert len(folders) == 1 and folders[0].startswith("train_grpo-") and f"run folder {tmp_path}/{folders[0]}" \
        in first.stdout, (folders, first.stdout[-2000:])
    assert [r["step"] for r in metrics(tmp_path / folders[0], "")] == [1, 2]


@pytest.mark.own_toy_assets
def test_toy_assets_built_by_several_nodes_at_once(tmp_path):
    """Nodes sharing the output folder each build the toy assets at start-up; one died on toy_assets/model.tmp
    (5 of 10 two-node SLURM jobs). Each build now happens in a folder of its own, renamed into place."""
    import subprocess
    import sys

    path = str(tmp_path / "toy_assets")
    # every node is inside its build before any renames (a state, not a timing): each waits in its first step for
    # the three build folders; a one-step warm start keeps the builds short, the renaming is the same
    code = (f"import glob, time\nfrom lib import toy\nsplit = toy.split_pairs\n"
            f"def inside(*a, **k):\n"
            f"    while len(glob.glob({path!r} + '.tmp-*')) < 3:\n        time.sleep(0.05)\n"
            f"    return split(*a, **k)\n"
            f"toy.split_pairs = inside\nprint(toy.prepare({path!r}, warm_steps=1)['model'])")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    assert os.listdir(tmp_path) == ["toy_assets"] and sorted(os.listdir(path)) == ["data", "model"]


def test_the_slurm_template_starts_on_a_fresh_clone_and_any_partition():
    """Its log went to runs/, which a fresh clone lacks (the job died before it started, FAILED with no output), and
    it hard-coded 8 GPUs, 64 CPUs and --exclusive (refused, or PENDING for ever, on a smaller partition)."""
    import re
    import subprocess

    text = open(os.path.join(ROOT, "slurm", "train.sbatch")).read()
    directives = re.findall(r"^#SBATCH\s+(\S+)", text, flags=re.M)
    output = next(d.split("=", 1)[1] for d in directives if d.startswith("--output="))
    folder = os.path.dirname(output)
    tracked = subprocess.run(["git", "ls-files", folder or "."], cwd=ROOT, capture_output=True, text=True).stdout
    assert not folder or tracked, f"--output={output}: {folder}/ is not in the repository"
    assert not [d for d in directives if d.split("=")[0] in ("--gpus-per-node", "--cpus-per-task", "--exclusive",
                                                            "--gres", "--mem")], directives
