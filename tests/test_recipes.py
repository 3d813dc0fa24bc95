"""Every README recipe and every preset, end to end on the toy task, in the configuration users run.

Recipes run on top of the tiny preset of their script; presets are shrunk to the toy model and data (sizes only:
every option stays, the sp4 preset runs sp=2 with gradient checkpointing, dynamic sampling and the overlong
penalty on 2 gloo ranks). Each runs 2 steps of its script's own main on 2 gloo ranks under torchrun, all of them
one after another in the same ranks (tests/runs_driver.py: the ranks' start-up, ~13 s of a loaded core a launch, is
paid once, not once a run); DAPO must need >= 2 generation rounds.
Every flag written in README.md and docs/ (inline and in bash blocks) and every preset key is also checked against
the command line.
"""

import json
import os
import re
import shlex

import pytest

from lib import config, preflight
from lib.runfolder import flat_config
from tests.conftest import link_assets
from tests.helpers import launch_runs, run_rows
from tests.test_e2e import ROOT

PAGES = {name: open(os.path.join(ROOT, name)).read() for name in
         ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))]}
"""The README and every page of docs/: their recipes and command lines are checked here."""
README = "\n".join(PAGES.values())
RECIPES = [(name.strip(), script.strip(), shlex.split(flags)) for name, script, flags in
           re.findall(r"^\| ([^|`]+?) \| (train_\w+\.py) \| `([^`]+)`", README, flags=re.M)]
# sizes a toy run cannot take: (flag, toy value)
SHRINK = {"--algorithm.overlong_buffer": "4"}
STEPS = ("--trainer.total_steps", "2", "--trainer.val_every", "0", "--trainer.save_every", "0")


def shrink(flags):
    out = list(flags)
    for i, token in enumerate(out[:-1]):
        if token in SHRINK:
            out[i + 1] = SHRINK[token]
    return out


def run_name(name: str) -> str:
    return re.sub(r"\W+", "_", name).strip("_")


def rows(launched, name: str) -> list[dict]:
    """The run's metric rows, which must be its 2 steps (else the launch's output says why)."""
    return run_rows(launched, run_name(name), steps=2)


def test_the_readme_lists_the_recipes():
    names = [n for n, _, _ in RECIPES]
    for expected in ("GRPO", "Dr.GRPO", "DAPO", "GSPO", "CISPO", "GPG", "RLOO", "REINFORCE++", "REINFORCE++-baseline",
                     "OPO", "PPO, KL in the reward", "rollout correction, token", "rollout correction, sequence"):
        assert expected in names, names


def _command_spans(text):
    """Backtick spans and the lines of bash code blocks of the README and docs/ that are command lines or flag
    lists."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [ln for block in blocks for ln in block.replace("\\\n", " ").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", text) + lines:
        tokens = shlex.split(span, comments=True)
        if not tokens:
            continue
        if len(tokens) > 1 and tokens[1].startswith("bench/"):  # a bench command: the flags it hands our trainer
            for t in tokens:
                if t.startswith("--ours-args="):
                    yield span, shlex.split(t.removeprefix("--ours-args="))
            continue
        flags = [i for i, t in enumerate(tokens) if t.startswith("--") and "." in t]
        placeholder = any("..." in t or t.startswith("[") for t in tokens)  # a shape of a command, not one
        if not flags or placeholder or any("/" in tokens[i] or "section." in tokens[i] for i in flags):
            continue
        start = min(flags + [i for i, t in enumerate(tokens) if t == "--config"])
        yield span, tokens[start:]


def test_every_documented_flag_parses():
    spans = list(_command_spans(README))
    assert len(spans) >= len(RECIPES)
    for span, argv in spans:
        try:
            config.parse(argv)
        except SystemExit:
            pytest.fail(f"README.md or docs/: `{span}` is refused by the command line")
    for name in config.presets():  # an unknown or misspelt preset key is an error
        config.apply_delta(config.Config(), config.load_preset(name))


# Recipes whose flags make the configuration of a preset that a learning test launches whole (the sizes and steps
# aside): a 2-step launch here would only repeat it. test_recipes_run_whole_elsewhere holds each to its preset.
RECIPES_RUN_WHOLE_ELSEWHERE = {"GRPO": "tiny_cpu_grpo", "on-policy distillation": "tiny_cpu_opd"}


def test_recipes_run_whole_elsewhere():
    """Each recipe left out of the launches below gives, on the tiny preset of its script, the configuration of the
    preset named for it, a preset launched whole by its learning test (RUN_WHOLE_ELSEWHERE)."""
    sizes = ("trainer.total_steps",)
    for name, preset in RECIPES_RUN_WHOLE_ELSEWHERE.items():
        (script, flags), = [(s, f) for n, s, f in RECIPES if n == name]
        assert preset in RUN_WHOLE_ELSEWHERE and script == "train_grpo.py", name
        got, want = (config.parse(argv, default_preset="tiny_cpu_grpo") for argv in (flags, ["--config", preset]))
        for cfg in (got, want):
            preflight.resolve(cfg)  # the values filled at start-up (the script's own estimator, ...)
        got, want = (flat_config(config.to_dict(cfg)) for cfg in (got, want))
        assert {k: (got[k], want[k]) for k in got if got[k] != want[k] and k not in sizes} == {}, name


LAUNCHED = [r for r in RECIPES if r[0] not in RECIPES_RUN_WHOLE_ELSEWHERE]


def _recipe_args(name, script, flags):
    extra = ["--trainer.train_batch_size", "16", "--actor.mini_batch_size", "64"]
    if script == "train_ppo.py":
        extra = ["--trainer.train_batch_size", "32", "--actor.mini_batch_size", "64", "--critic.mini_batch_size", "64"]
    if name == "DAPO":  # a low temperature makes most groups uniform: dynamic sampling needs more rounds
        extra += ["--rollout.temperature", "0.3"]
    return [*STEPS, *extra, *shrink(flags)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, shared_assets_dir):
    """Every launched recipe and preset of this module, run after run in one launch (tests/runs_driver.py), under
    one output root holding the session's builds of the toy tasks: (the root, the launch's finished process)."""
    root = tmp_path_factory.mktemp("recipes")
    link_assets(shared_assets_dir, ["toy_assets", "toy_teacher_assets", "toy_vision_assets"], str(root))
    where = ["--trainer.output_root", str(root), "--trainer.run_name"]
    plan = [(name, script, [*_recipe_args(name, script, flags), *where, run_name(name)])
            for name, script, flags in LAUNCHED]
    plan += [(name, _preset_script(name), [*_preset_args(name), *where, run_name(name)]) for name in PRESETS]
    assert len({run_name(name) for name, _, _ in plan}) == len(plan)  # a run folder each
    return root, launch_runs(plan, root)


@pytest.mark.slow
def test_the_launch_of_every_recipe_and_preset_ends_cleanly(launched):
    _, out = launched
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.parametrize("name,script,flags", LAUNCHED, ids=[n for n, _, _ in LAUNCHED])
def test_recipe_runs_end_to_end(launched, name, script, flags):
    got = rows(launched, name)
    part = "critic" if script == "train_ppo.py" else "actor"  # the PPO preset warms the critic up first
    assert all(r[f"{part}/skipped_steps"] == 0 and r[f"{part}/grad_norm"] > 0 for r in got), got
    if name == "DAPO":
        assert all(r["algorithm/gen_rounds"] >= 2 and r["algorithm/kept_groups"] == 16 for r in got), got
    if name.startswith("rollout correction"):
        assert all(abs(r["rollout_is_mean"] - 1) < 1e-3 for r in got)  # same weights on both sides
    if name.startswith("bypass"):  # the update's old log-probs are the engine's own
        assert all(r["rollout/logp_abs_diff"] == 0.0 for r in got), got
    if name == "GSPO":  # the loss's own clip range, resolved and saved
        saved = open(launched[0] / run_name(name) / "config.yaml").read()
        assert "clip_ratio_low: 0.0003" in saved and "clip_ratio_high: 0.0004" in saved, saved


def _preset_args(name):
    preset = config.load_preset(name)
    n = preset.get("rollout", {}).get("n", 8)
    prompts = 16
    mini = prompts * n // 2  # two optimizer steps per RL step
    # a vision-language preset shrinks to the visual task (lib/vision/toy.py), the others to the digit task
    toy, width = ("toy_vision", "16") if preset.get("actor", {}).get("model", {}).get("max_pixels") \
        or "vision" in name else ("toy", "10")
    args = ["--config", name, "--actor.model.path", toy, "--data.train_files", toy, "--data.val_files", toy,
            "--data.max_prompt_length", width, "--rollout.max_response_length", "10", "--rollout.engine", "hf",
            "--trainer.train_batch_size", str(prompts), "--actor.mini_batch_size", str(mini),
            "--critic.mini_batch_size", str(mini), "--actor.batching.max_tokens_per_rank", "64",
            "--critic.batching.max_tokens_per_rank", "64", "--trainer.logger", "console", "jsonl",
            "--actor.optim.lr", "1e-4", *STEPS]
    if toy == "toy_vision":  # the toy's own 56 x 56 images (the preset's pixel bounds are a real model's)
        args += ["--actor.model.min_pixels", "0", "--actor.model.max_pixels", "0"]
    if preset.get("distill", {}).get("teacher"):  # the toy's teacher (lib/toy.py prepare_teacher)
        args += ["--distill.teacher", "toy_teacher"]
    if preset.get("trainer", {}).get("sp_size", 1) > 1:
        args += ["--trainer.sp_size", "2"]
    if preset.get("algorithm", {}).get("overlong_buffer"):
        args += ["--algorithm.overlong_buffer", "4"]
    return args


# Presets that another test launches whole, in a learning test (more steps than here): a launch here would only
# repeat it.
# test_every_preset_runs_somewhere holds each entry to its test.
RUN_WHOLE_ELSEWHERE = {
    "tiny_cpu_grpo": ("test_e2e.py", "test_grpo_toy_reward_rises", 'torchrun("train_grpo.py", tmp_path, '),
    "tiny_cpu_ppo": ("test_e2e.py", "test_ppo_toy_reward_rises", 'torchrun("train_ppo.py", tmp_path, '),
    "tiny_cpu_opd": ("test_distill.py", "test_distillation_learns_the_toy_task_faster_than_grpo", '"tiny_cpu_opd"'),
    "tiny_cpu_grpo_tools": ("test_multi_turn.py", "test_tool_task_reward_rises", "configs/tiny_cpu_grpo_tools.yaml"),
    "tiny_cpu_grpo_agent": ("test_agents.py", "test_an_openai_sdk_agent_learns_the_tool_task_as_the_multi_turn_loop_does",
                            "configs/tiny_cpu_grpo_agent.yaml"),
    "tiny_cpu_grpo_vision": ("test_vision.py", "test_the_visual_task_is_learned", "*PRESET)"),
    "tiny_cpu_grpo_judge": ("test_judges.py",
                            "test_grpo_learns_the_toy_task_from_the_toy_judge_beside_the_policy_and_behind_an_endpoint",
                            '"tiny_cpu_grpo_judge"'),
}


def test_every_preset_runs_somewhere():
    """Each preset left out below is launched whole by the test named for it: the test exists, and its launch
    names the preset (the scripts' default preset where it names none)."""
    import importlib
    import inspect

    for name, (file, test, launch) in RUN_WHOLE_ELSEWHERE.items():
        assert name in config.presets(), name
        module = importlib.import_module(f"tests.{file[:-3]}")
        assert launch in inspect.getsource(getattr(module, test)), (name, test)
    assert "configs/tiny_cpu_grpo_vision.yaml" in importlib.import_module("tests.test_vision").PRESET
    for script, preset in (("train_grpo.py", "tiny_cpu_grpo"), ("train_ppo.py", "tiny_cpu_ppo")):
        assert f'default_preset="{preset}"' in open(os.path.join(ROOT, script)).read()


PRESETS = [p for p in config.presets() if p not in RUN_WHOLE_ELSEWHERE]


def _preset_script(name):
    return "train_ppo.py" if config.load_preset(name).get("algorithm", {}).get("adv_estimator") == "gae" \
        else "train_grpo.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_end_to_end(launched, name):
    got = rows(launched, name)
    part = "critic" if _preset_script(name) == "train_ppo.py" else "actor"
    assert all(r[f"{part}/skipped_steps"] == 0 for r in got), got
