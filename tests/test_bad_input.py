"""Bad input: each case exits 2 with one message that names the problem, printed once, before any rank starts; no
traceback, no torchrun failure block, nothing written.

``bash launch.sh`` runs every input check in one process (``python -m lib.check SCRIPT WORLD_SIZE ...``) before
torchrun starts a rank. Every case runs that check, in one process for all of them (``lib.check.main`` with the
arguments launch.sh gives it, its output captured per case at the file descriptors, so what a library writes there
itself, a logging handler or C code, is seen as launch.sh would show it: each case's own process would spend its
seconds on imports); the cases of THROUGH_LAUNCH also run through the real entry point, ``bash launch.sh`` with two
ranks."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("Traceback", "ChildFailedError", "torch.distributed.elastic", "[rank")


@pytest.fixture(scope="module")
def files(tmp_path_factory, shared_assets_dir):
    from lib.vision import toy as vision_toy
    from tests.conftest import link_assets

    d = tmp_path_factory.mktemp("bad_input")
    # the session's builds of the embedded tasks, where the runs' output root has them (the visual one for the image
    # rows below); the checks find them as if they had built them
    link_assets(shared_assets_dir, ["toy_assets", "toy_vision_assets"], str(d / "runs"))
    good = {"prompt": [{"role": "user", "content": "1,2,3,4,"}], "data_source": "toy",
            "reward_model": {"ground_truth": "4,3,2,1"}}

    def jsonl(name, rows, raw=None):
        path = d / name
        path.write_text(raw if raw is not None else "\n".join(json.dumps(r) for r in rows) + "\n")
        return str(path)

    out = {
        "garbage_parquet": jsonl("garbage.parquet", [], raw="this is not parquet"),
        "garbage_jsonl": jsonl("garbage.jsonl", [], raw="{not json\n"),
        "empty": jsonl("empty.jsonl", [], raw=""),
        "no_prompt": jsonl("no_prompt.jsonl", [good, {"data_source": "toy"}]),
        "empty_messages": jsonl("empty_messages.jsonl", [good, {**good, "prompt": []}]),
        "no_content": jsonl("no_content.jsonl", [good, {**good, "prompt": [{"role": "user", "content": 5}]}]),
        "null_source": jsonl("null_source.jsonl", [good, {**good, "data_source": None}]),
        "unknown_source": jsonl("unknown_source.jsonl", [good, {**good, "data_source": "mystery"}]),
        "no_truth": jsonl("no_truth.jsonl", [good, {**good, "reward_model": {}}]),
        "empty_prompt": jsonl("empty_prompt.jsonl", [good, {**good, "prompt": "   "}]),
        "not_object": jsonl("not_object.jsonl", [good, [1, 2]]),
        "long": jsonl("long.jsonl", [good, {**good, "prompt": [{"role": "user", "content": "1," * 400}]}]),
        "text": jsonl("data.txt", [good]),
        # TRL's layout: a prompt and a solution column, no reward_model
        "trl": jsonl("trl.jsonl", [{"prompt": [{"role": "user", "content": "1,2,3,4,"}], "solution": "4,3,2,1"}]),
    }
    # data read through datasets (issue 44): parquet files made by pyarrow, then spoiled
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name, rows, schema=None):
        path = d / name
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        return str(path)

    whole = parquet("whole.parquet", [good] * 64)
    (d / "cut.parquet").write_bytes(open(whole, "rb").read()[: os.path.getsize(whole) // 2])
    (d / "zero.parquet").write_bytes(b"")
    (d / "parquet_bytes.jsonl").write_bytes(open(whole, "rb").read())
    (d / "nothing_here").mkdir()
    (d / "empty.json").write_text("[]")
    out.update({
        "cut_parquet": str(d / "cut.parquet"), "zero_parquet": str(d / "zero.parquet"),
        "parquet_as_jsonl": str(d / "parquet_bytes.jsonl"), "empty_json": str(d / "empty.json"),
        "no_rows_parquet": parquet("no_rows.parquet", [], pa.schema([("prompt", pa.string()),
                                                                     ("data_source", pa.string())])),
        "no_prompt_parquet": parquet("no_prompt.parquet", [{"data_source": "toy", "x": 1}]),
        "int_prompt_parquet": parquet("int_prompt.parquet", [{**good, "prompt": 7}]),
        "glob_nothing": str(d / "shards" / "train-*.parquet"), "empty_folder": str(d / "nothing_here"),
    })
    bad_images = vision_toy.rows(2, seed=0)
    bad_images[1]["images"][0]["bytes"] = b"not an image"  # image bytes that do not decode
    out["bad_images"] = parquet("bad_images.parquet", bad_images)
    cut_images = vision_toy.rows(2, seed=0)
    png = cut_images[1]["images"][0]["bytes"]
    cut_images[1]["images"][0]["bytes"] = png[: len(png) // 2]  # a PNG cut short: its header (and size) intact
    out["cut_images"] = parquet("cut_images.parquet", cut_images)
    # LoRA adapter folders (issue 59): without a rank, cut short, without weights, and a whole one (as a model path)
    adapter = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA",
               "lora_dropout": 0.0, "bias": "none"}
    for name, text in (("adapter_no_r", json.dumps({k: v for k, v in adapter.items() if k != "r"})),
                       ("adapter_cut", json.dumps(adapter, indent=2)[:60]), ("adapter_no_weights", json.dumps(adapter)),
                       ("adapter_ok", json.dumps(adapter))):
        (d / name).mkdir()
        (d / name / "adapter_config.json").write_text(text)
        out[name] = str(d / name)
    (d / "adapter_ok" / "adapter_model.safetensors").write_bytes(b"")
    (d / "jinja_template.txt").write_text("Question: {question}\nAnswer: {{response}}\nScore 0-10:")
    out["jinja_template"] = str(d / "jinja_template.txt")
    out["vision_preset"] = os.path.join(ROOT, "configs", "tiny_cpu_grpo_vision.yaml")
    (d / "list.yaml").write_text("- actor\n- rollout\n")
    out["list_yaml"] = str(d / "list.yaml")
    (d / "broken_reward.py").write_text("import not_a_module_anywhere\n")
    (d / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    out["broken_reward"], out["reward"] = str(d / "broken_reward.py"), str(d / "reward.py")
    out["vault"] = os.path.join(ROOT, "tests", "data", "mt_tools.py") + ":Vault"  # a tool environment
    out["root"] = str(d / "runs")
    # a verifiers environment that is installed (on the checks' path) but imports a module that is not
    (d / "site" / "broken_taskset").mkdir(parents=True)
    (d / "site" / "broken_taskset" / "__init__.py").write_text("import no_such_dependency_of_the_taskset\n")
    out["site"] = str(d / "site")
    out["toy_server"] = os.path.join(ROOT, "tests", "envs", "toy_openenv.py")
    # a run folder holding a finished run of another config, and one holding any run (for resume off)
    for name, lr in (("other", 0.5), ("existing", 0.5)):
        run = d / "runs" / name
        (run / "checkpoints" / "step_2").mkdir(parents=True)
        (run / "checkpoints" / "latest").write_text("2")
        (run / "config.yaml").write_text(f"actor:\n  optim:\n    lr: {lr}\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return out


CASES = [  # (id, script, arguments (with {file} placeholders), what the one message must say)
    ("bool-as-value", "train_grpo.py", "--algorithm.filter_groups true", "use --algorithm.filter-groups"),
    ("bool-off", "train_grpo.py", "--trainer.resume off", "use --trainer.no-resume"),
    ("unknown-flag", "train_grpo.py", "--actor.lrr 1", "Unrecognized options: --actor.lrr"),
    ("unknown-preset", "train_grpo.py", "--config nope", "no config file or preset 'nope'"),
    ("bad-choice", "train_grpo.py", "--actor.policy_loss nope", "nope"),
    ("temperature", "train_grpo.py", "--rollout.temperature 0", "rollout.temperature=0.0"),
    ("top-p", "train_grpo.py", "--rollout.top_p 1.5", "rollout.top_p=1.5"),
    ("top-k", "train_grpo.py", "--rollout.top_k -1", "rollout.top_k=-1"),
    ("group-n", "train_grpo.py", "--rollout.n 1", "rollout.n=1"),
    ("val-n", "train_grpo.py", "--rollout.val_n 0", "rollout.val_n=0"),
    ("steps", "train_grpo.py", "--trainer.total_steps -1", "trainer.total_steps=-1"),
    ("epochs", "train_grpo.py", "--trainer.total_steps 0 --trainer.epochs 0", "trainer.epochs=0"),
    ("val-every", "train_grpo.py", "--trainer.val_every -1", "trainer.val_every=-1"),
    ("save-every", "train_grpo.py", "--trainer.save_every -1", "trainer.save_every=-1"),
    ("keep-last", "train_grpo.py", "--trainer.keep_last -1", "trainer.keep_last=-1"),
    ("max-bad-steps", "train_grpo.py", "--trainer.max_bad_steps 0", "trainer.max_bad_steps=0"),
    ("samples-share", "train_grpo.py", "--samples.share 2", "samples.share=2 is a share"),
    # trackio is not in .venv (test.sh installs it apart): the logger is refused, naming the extra
    ("trackio-missing", "train_grpo.py", "--trainer.logger console trackio",
     "trainer.logger trackio needs the trackio package: pip install -e .[trackio]"),
    ("ppo-estimator", "train_ppo.py", "--algorithm.adv_estimator grpo", "train_ppo.py computes advantages with GAE"),
    ("ppo-filter-groups", "train_ppo.py", "--algorithm.filter-groups", "is train_grpo.py's; turn it off"),
    ("gamma", "train_ppo.py", "--algorithm.gamma 1.5", "algorithm.gamma=1.5"),
    ("lam", "train_ppo.py", "--algorithm.lam -0.1", "algorithm.lam=-0.1"),
    ("overlong", "train_grpo.py", "--algorithm.overlong_buffer -1", "algorithm.overlong_buffer=-1"),
    ("kl-horizon", "train_ppo.py", "--algorithm.kl_ctrl.type adaptive --algorithm.kl_ctrl.horizon 0",
     "algorithm.kl_ctrl.horizon=0"),
    ("reward-timeout", "train_grpo.py", "--reward.timeout_s 0", "reward.timeout_s=0.0"),
    ("reward-workers", "train_grpo.py", "--reward.num_workers 0", "reward.num_workers=0"),
    ("logger", "train_grpo.py", "--trainer.logger console bogus", "unknown name(s) ['bogus']"),
    ("lr", "train_grpo.py", "--actor.optim.lr -1", "actor.optim.lr=-1.0"),
    ("warmup", "train_grpo.py", "--actor.optim.warmup_steps -1", "actor.optim.warmup_steps=-1"),
    ("grad-norm", "train_grpo.py", "--actor.optim.max_grad_norm 0", "actor.optim.max_grad_norm=0.0"),
    ("batch-vs-ranks", "train_grpo.py", "--trainer.train_batch_size 7", "7"),
    ("mini-batch", "train_grpo.py", "--actor.mini_batch_size 5", "must divide by the 2 ranks"),
    ("sp-size", "train_grpo.py", "--trainer.sp_size 3", "sp_size"),
    ("shard-size", "train_grpo.py", "--actor.fsdp.shard_size 3", "actor.fsdp.shard_size=3 must divide the 2 ranks"),
    ("n-zero", "train_grpo.py", "--rollout.n 0", "rollout.n=0 must be >= 1"),
    ("lora-dropout", "train_grpo.py", "--actor.lora.rank 8 --actor.lora.dropout 0.05", "set actor.lora.dropout 0"),
    ("lora-head", "train_ppo.py", "--actor.lora.rank 8 --actor.lora.target_modules lm_head q_proj",
     "target the decoder's linear layers only"),
    ("lora-no-adapter", "train_grpo.py", "--actor.lora.adapter_path /nonexistent/adapter",
     "holds no adapter_config.json"),
    ("n-zero-ppo", "train_ppo.py", "--rollout.n 0", "rollout.n=0 must be >= 1"),
    ("preset-list", "train_grpo.py", "--config {list_yaml}", "must hold a mapping of config sections"),
    ("model-path", "train_grpo.py", "--actor.model.path /nope/model", "/nope/model"),
    ("critic-path", "train_ppo.py", "--critic.model.path /nope/critic", "/nope/critic"),
    ("reward-model-path", "train_grpo.py", "--reward.reward_model /nope/rm", "/nope/rm"),
    ("train-file", "train_grpo.py", "--data.train_files /nope.parquet", "/nope.parquet"),
    ("file-kind", "train_grpo.py", "--data.train_files {text}", "neither .parquet nor .jsonl"),
    ("reward-spec", "train_grpo.py", "--reward.custom_fn nofunction", "path/to/file.py:function_name"),
    ("reward-file", "train_grpo.py", "--reward.custom_fn /nope.py:score", "does not exist"),
    ("reward-fn", "train_grpo.py", "--reward.custom_fn {reward}:missing", "has no function 'missing'"),
    ("reward-import", "train_grpo.py", "--reward.custom_fn {broken_reward}:score", "failed to import"),
    ("trl-rows-no-truth", "train_grpo.py", "--data.train_files {trl} --data.val_files {trl} --reward.custom_fn "
     "{reward}:score", "no data row has reward_model.ground_truth"),
    ("garbage-parquet", "train_grpo.py", "--data.train_files {garbage_parquet}", "cannot be read as parquet"),
    ("garbage-jsonl", "train_grpo.py", "--data.train_files {garbage_jsonl}", "cannot be read as JSON lines"),
    ("empty-file", "train_grpo.py", "--data.train_files {empty}", "empty.jsonl is an empty file (0 bytes)"),
    ("zero-bytes-parquet", "train_grpo.py", "--data.train_files {zero_parquet}", "is an empty file (0 bytes)"),
    ("no-rows-parquet", "train_grpo.py", "--data.train_files {no_rows_parquet}", "no_rows.parquet holds no rows"),
    ("cut-parquet", "train_grpo.py", "--data.train_files {cut_parquet}", "cut.parquet cannot be read as parquet "
     "(a damaged or cut-short file"),
    ("parquet-as-jsonl", "train_grpo.py", "--data.train_files {parquet_as_jsonl}", "cannot be read as JSON lines "
     "(not UTF-8 text"),
    ("empty-json", "train_grpo.py", "--data.train_files {empty_json}", "empty.json holds no rows"),
    ("no-prompt-parquet", "train_grpo.py", "--data.train_files {no_prompt_parquet}", "row 0: no 'prompt'"),
    ("int-prompt-parquet", "train_grpo.py", "--data.train_files {int_prompt_parquet}", "int_prompt.parquet row 0:"),
    ("glob-nothing", "train_grpo.py", "--data.train_files {glob_nothing}", "the pattern matches no "
     ".parquet/.jsonl/.json file"),
    ("empty-folder", "train_grpo.py", "--data.train_files {empty_folder}", "holds no .parquet/.jsonl/.json file"),
    ("bad-image-bytes", "train_grpo.py", "--config {vision_preset} --data.train_files {bad_images}",
     "bad_images.parquet row 1: image 0: image (12 bytes) is in no format PIL reads"),
    ("cut-image", "train_grpo.py", "--config {vision_preset} --data.train_files {cut_images}",
     "cut_images.parquet row 1: image 0: image ("),
    ("lora-adapter-no-r", "train_grpo.py", "--actor.lora.adapter_path {adapter_no_r}", "has no LoRA rank"),
    ("lora-adapter-cut", "train_grpo.py", "--actor.lora.adapter_path {adapter_cut}",
     "adapter_cut/adapter_config.json is not valid JSON"),
    ("lora-adapter-no-weights", "train_grpo.py", "--actor.lora.adapter_path {adapter_no_weights}",
     "holds no adapter_model.safetensors"),
    ("adapter-as-model", "train_grpo.py", "--actor.model.path {adapter_ok}", "is a LoRA adapter folder"),
    ("lora-alpha-zero", "train_grpo.py", "--actor.lora.rank 8 --actor.lora.alpha 0", "actor.lora.alpha=0 scales"),
    ("lora-flags-without-rank", "train_grpo.py", "--actor.lora.target_modules q_proj v_proj",
     "set, but LoRA is off"),
    ("lora-merge-without-rank", "train_grpo.py", "--actor.lora.merge", "actor.lora.merge=True set, but LoRA is off"),
    ("judge-jinja-braces", "train_grpo.py", "--judge.url http://127.0.0.1:9/v1 --judge.model m "
     "--judge.template {jinja_template}",
     "it has {{response}}, which str.format renders"),
    ("judge-negative-weight", "train_grpo.py", "--judge.url http://127.0.0.1:9/v1 --judge.model m "
     "--judge.weight -1",
     "a negative weight trains the policy against that score"),
    ("no-prompt", "train_grpo.py", "--data.train_files {no_prompt}", "row 1: no 'prompt'"),
    ("empty-messages", "train_grpo.py", "--data.train_files {empty_messages}", "row 1: an empty message list"),
    ("no-content", "train_grpo.py", "--data.train_files {no_content}", "row 1: prompt message 0 has no string"),
    ("null-source", "train_grpo.py", "--data.train_files {null_source}", "row 1: no 'data_source'"),
    ("unknown-source", "train_grpo.py", "--data.train_files {unknown_source}", "no scorer for data_source 'mystery'"),
    ("no-truth", "train_grpo.py", "--data.train_files {no_truth}", "row 1: no 'reward_model.ground_truth'"),
    ("empty-prompt", "train_grpo.py", "--data.train_files {empty_prompt}", "row 1: an empty prompt"),
    ("not-object", "train_grpo.py", "--data.train_files {not_object}", "row 1: a row must be an object"),
    ("too-long", "train_grpo.py", "--data.train_files {long} --data.truncation error", "row 1: a prompt of"),
    ("tools-file", "train_grpo.py", "--multi_turn.tools /nope.py:tools", "multi_turn.tools file '/nope.py' does "
     "not exist"),
    ("tools-format", "train_grpo.py", "--multi_turn.tools {reward}:score --multi_turn.format xml",
     "multi_turn.format='xml'; use one of"),
    ("tools-schema", "train_grpo.py", "--multi_turn.tools {reward}:score", "cannot be read from its signature and "
     "docstring"),
    ("rg-task", "train_grpo.py", "--data.train_files reasoning_gym:no_such_task",
     "reasoning_gym has no task ['no_such_task']"),
    ("rg-setting", "train_grpo.py", "--data.val_files reasoning_gym:leg_counting:leg_counting.bogus=1",
     "reasoning_gym task leg_counting refuses the settings"),
    ("vf-env", "train_grpo.py", "--data.train_files verifiers:no-such-env-anywhere",
     "verifiers environment 'no-such-env-anywhere' with {} cannot be loaded"),
    ("vf-env-dependency", "train_grpo.py", "--data.train_files verifiers:broken-taskset",
     "verifiers environment 'broken-taskset' is installed but cannot be imported: it imports "
     "'no_such_dependency_of_the_taskset', which is not installed"),
    ("env-app-attribute-file", "train_grpo.py", "--env.app {toy_server}:no_such_app",
     "toy_openenv.py defines no 'no_such_app' at its top level"),
    ("env-app-attribute-module", "train_grpo.py", "--env.app tests.envs.toy_openenv:no_such_app",
     "toy_openenv.py defines no 'no_such_app' at its top level"),
    ("env-unreachable", "train_grpo.py", "--env.url http://127.0.0.1:9 --env.max_retries 1 --env.backoff_s 0.01",
     "the OpenEnv server at http://127.0.0.1:9 cannot be reached"),
    ("env-both", "train_grpo.py", "--env.url http://127.0.0.1:9 --env.app server.py:app",
     "both name an environment server; keep one"),
    ("env-action-fields", "train_grpo.py", "--env.url http://127.0.0.1:9 --env.action_fields [1]",
     "env.action_fields='[1]' must be a JSON object"),
    ("env-tools", "train_grpo.py", "--env.url http://127.0.0.1:9 --multi_turn.tools {reward}:score",
     "env and multi_turn.tools both drive the turns"),
    ("env-app-file", "train_grpo.py", "--env.app /nope/server.py:app", "env.app: the file '/nope/server.py' does "
     "not exist"),
    ("env-app-module", "train_grpo.py", "--env.app no_such_env_pkg.server:app",
     "no module 'no_such_env_pkg' is installed"),
    ("env-custom", "train_grpo.py", "--env.app no_such_env_pkg.server:app --reward.custom_fn {reward}:score",
     "with an environment whose return is the whole reward"),
    ("env-verifiers-data", "train_grpo.py", "--env.verifiers", "['toy'] are not rows of a verifiers environment: "
     "name them as verifiers:ENV_ID"),
    ("agent-file", "train_grpo.py", "--agent.entry /nope/agent.py:run", "agent.entry file '/nope/agent.py' does not "
     "exist"),
    ("agent-function", "train_grpo.py", "--agent.entry {reward}:no_such_agent", "has no function 'no_such_agent'"),
    ("agent-module", "train_grpo.py", "--agent.entry no_such_agent_pkg.agents:run",
     "module 'no_such_agent_pkg.agents' failed to import"),
    ("agent-signature", "train_grpo.py", "--agent.entry {reward}:score", "it must take (row, base_url)"),
    ("agent-command", "train_grpo.py", "--agent.command no_such_program_anywhere",
     "'no_such_program_anywhere' is not a program on PATH"),
    ("agent-both", "train_grpo.py", "--agent.entry {reward}:score --agent.command ls",
     "both name the agent; keep one"),
    ("agent-tools", "train_grpo.py", "--agent.command ls --multi_turn.tools {vault}",
     "agent drives its episodes' turns itself, and multi_turn.tools would too"),
    ("agent-partial", "train_grpo.py", "--agent.command ls --rollout.partial.enabled",
     "agent drives its episodes' turns itself, and rollout.partial would too"),
    ("partial-tools-env", "train_grpo.py", "--rollout.partial.enabled --multi_turn.tools {vault}",
     "mt_tools.py:Vault, an environment: its instances live in the tool workers"),
    ("partial-env", "train_grpo.py", "--rollout.partial.enabled --env.url http://127.0.0.1:9",
     "rollout.partial with an environment (env): an episode's session lives in its server"),
    ("partial-distill-loss", "train_grpo.py",
     "--distill.teacher {root}/toy_assets/model --distill.mode loss --rollout.partial.enabled",
     "rollout.partial with distill.mode=loss: its term over the sampled tokens is not weighted"),
    ("partial-routing", "train_grpo.py", "--rollout.partial.enabled --rollout.routing-replay",
     "rollout.partial with rollout.routing_replay: a continued sample's prefix is prefilled again"),
    # partial rollouts' reason first: before, a refusal of rollout_correction=token came first, a value partial
    # rollouts set, not the user
    ("partial-bypass", "train_grpo.py", "--rollout.partial.enabled --algorithm.bypass-mode",
     "cannot run:\n  - rollout.partial with algorithm.bypass_mode: the engine's log-probs of a carried sample are an "
     "older policy's, not the update's old policy: turn bypass_mode off"),
    ("partial-budget", "train_grpo.py", "--rollout.partial.enabled --rollout.partial.step_token_budget -1",
     "rollout.partial.step_token_budget=-1 must be >= 0"),
    ("partial-staleness", "train_grpo.py", "--rollout.partial.enabled --rollout.partial.max_staleness 0",
     "rollout.partial.max_staleness=0 must be >= 1"),
    ("resume-off", "train_grpo.py", "--trainer.run_name existing --trainer.no-resume", "trainer.resume is off"),
    ("changed-config", "train_grpo.py", "--trainer.run_name other", "actor.optim.lr: 0.5 -> 0.001"),
]


DATA_FILES = {"garbage-parquet", "garbage-jsonl", "empty-file", "zero-bytes-parquet", "no-rows-parquet",
              "cut-parquet", "parquet-as-jsonl", "empty-json", "no-prompt-parquet", "int-prompt-parquet",
              "glob-nothing", "empty-folder", "bad-image-bytes", "cut-image"}
"""The kinds of bad data file (issue 44: datasets' own errors were a traceback, printed twice)."""
THROUGH_LAUNCH = {"unknown-flag", "changed-config", "cut-parquet", "glob-nothing", "cut-image",
                  "lora-adapter-no-weights", "judge-jinja-braces"}
"""A command-line error (tyro's), an existing run folder, a bad data file of each reader (a parquet file through
datasets, a pattern, image rows: a PNG cut short after its header), an adapter folder and a judge template. Every
case (the config checks, every kind of bad data file) runs in the driver below, whose capture sees what launch.sh's
output would (each through launch.sh too cost ~12 s of a loaded 2-core machine a case, most of it imports)."""

DRIVER = """
import json, os, sys, tempfile, traceback
from lib import check
cases = json.load(sys.stdin)
result = os.fdopen(os.dup(1), "w")  # the report's own channel: fd 1 and 2 are each case's capture below
out = {}
for name, argv in cases:
    with tempfile.TemporaryFile("w+") as f:
        saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)  # sys.stdout and sys.stderr write there too: they sit on these descriptors
        try:
            code = check.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd in (1, 2):
                os.dup2(saved[fd - 1], fd)
                os.close(saved[fd - 1])
        f.seek(0)
        out[name] = [code, f.read()]
json.dump(out, result)
result.close()
"""


def _argv(case, files):
    _, script, args, _ = case
    return [script, "--trainer.output_root", files["root"], *args.format(**files).split()]


@pytest.fixture(scope="module")
def checked(files):
    """Every case through lib.check.main in one process, as launch.sh calls it with two ranks: name -> (exit code,
    output), and the written files' times before and after."""
    before = {p: os.path.getmtime(p) for p in _written(files["root"])}
    cases = [[c[0], [c[1], "2", *_argv(c, files)[1:]]] for c in CASES]
    path = os.pathsep.join(filter(None, [files["site"], os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), before, {p: os.path.getmtime(p) for p in _written(files["root"])}


def _one_clean_message(code, text, expected):
    assert code == 2, text[-3000:]
    assert expected in text, text[-3000:]
    assert text.count(expected) == 1, text  # once, not once per rank
    assert not any(n in text for n in NOISE), text[-3000:]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clean_message(case, checked):
    results, before, after = checked
    code, text = results[case[0]]
    _one_clean_message(code, text, case[3])
    assert after == before  # no case wrote or touched a file


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in THROUGH_LAUNCH], ids=sorted(THROUGH_LAUNCH, key=[
    c[0] for c in CASES].index))
def test_bad_input_through_launch_sh(case, files):
    argv = ["bash", "launch.sh", *_argv(case, files)]
    before = {p: os.path.getmtime(p) for p in _written(files["root"])}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NPROC": "2"})
    _one_clean_message(out.returncode, out.stdout + out.stderr, case[3])
    assert {p: os.path.getmtime(p) for p in _written(files["root"])} == before  # nothing written or touched


def _written(root):
    found = []
    for base, _, names in os.walk(root):
        if "toy_assets" not in base:
            found += [os.path.join(base, n) for n in names]
    return found


# ---- refusals and stops from inside the ranks (issue 44): the rank's message alone, its exit code kept


def _launch(tmp_path, model: str, *flags: str, **hooks: str) -> subprocess.CompletedProcess:
    """A 2-rank bash launch.sh run of 2 GRPO steps of the zoo model at ``model`` on the zoo's data, the test hooks of
    tests/child_hooks set as ``hooks``."""
    from tests import zoo
    from tests.helpers import child_env

    argv = ["bash", "launch.sh", "train_grpo.py", *zoo.grpo_args(model, str(tmp_path)), *flags]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=child_env(NPROC="2", **hooks))


@pytest.mark.slow
def test_a_refusal_inside_the_ranks_is_its_message_alone(tmp_path):
    """The start-up self-check refuses a model whose layers leak across packed sequences (here LFM2 with its
    convolutions left unbounded, as an architecture lib/mixers.py does not know): exit 2, the message once, naming
    the class and the two ways on; before, torchrun's ChildFailedError dump followed it and read as a crash."""
    from tests import zoo

    out = _launch(tmp_path, zoo.build("lfm2", str(tmp_path / "models")), RL_BLIND_MIXERS="1")
    text = out.stdout + out.stderr
    _one_clean_message(out.returncode, text, "computes another model under packing")
    assert "'Lfm2ShortConv' to NAMES in lib/mixers.py" in text and "--actor.batching.no-use-remove-padding" in text


@pytest.mark.slow
def test_a_stop_by_the_canary_keeps_its_exit_code_and_shows_its_message_alone(tmp_path):
    """A stop (exit 3: the canary, here at a bound below fp32 noise) through launch.sh: the message once, exit 3
    (SLURM's requeue logic reads it), no torchrun failure block."""
    from tests import zoo

    out = _launch(tmp_path, zoo.build("qwen2_tied", str(tmp_path / "models")), "--rollout.logp_diff_limit", "1e-12")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    assert text.count("error: rollout/logp_abs_diff") == 1 and not any(n in text for n in NOISE), text[-3000:]
    # what is on disk, told as it is: the first step stopped before any checkpoint (before: "the last one is kept")
    assert "no checkpoint was written yet (trainer.save_every=" in text and "from step 0" in text, text[-3000:]


@pytest.mark.slow
def test_a_crash_inside_the_ranks_still_shows_everything(tmp_path):
    """A real crash (rank 0 reading weights cut short) is not a refusal: torchrun's report and the rank's traceback
    stay, and the exit code is torchrun's (restarts off: a crash that repeats is test_resume's)."""
    import shutil

    from tests import zoo

    model = str(tmp_path / "cut_model")
    shutil.copytree(zoo.build("qwen2_tied", str(tmp_path / "models")), model)
    weights = os.path.join(model, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    out = _launch(tmp_path, model, "--trainer.max_restarts", "0")
    text = out.stdout + out.stderr
    assert out.returncode not in (0, 2, 3), text[-3000:]
    assert "Traceback" in text and "ChildFailedError" in text, text[-3000:]
