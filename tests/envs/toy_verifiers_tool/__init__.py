"""The embedded toy tool task (lib/toy.py, the tool variant) as a multi-turn verifiers 0.4 environment, for the tests
(tests/test_envs.py): the id ``toy-verifiers-tool`` (this folder's parent on the path), a taskset of the task's keys
(train or val split), and an Env whose run() is the episode: the model's turn with a lookup call gets the digits
behind the key as a tool message, a turn without one is the answer, scored by the toy rule against the answer."""

import json
import re

import verifiers.v1 as vf
from toy_verifiers import ToyData, ToyTask  # the toy task's data and reward (tests/envs/toy_verifiers)

from lib import toy
from lib.rewards.builtin import toy as toy_rule

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class ToolTask(ToyTask):
    """The toy task's reward on the last reply where it is the answer (a reply with a call is none: an episode ended on
    a call scores 0, as tests/envs/toy_openenv.py's tool_app scores it), and a count of the lookups."""

    @vf.reward(weight=1.0)
    async def reversed_digits(self, task: ToyData, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return 0.0 if CALL.search(reply) else toy_rule(reply, task.answer)["score"]

    @vf.metric
    async def lookups(self, task: ToyData, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ToolConfig(vf.TasksetConfig):
    split: str = "train"
    fail: bool = False  # run() raises after the first turn (the tests of a failing environment)


class ToolTaskset(vf.Taskset[ToolTask, ToolConfig]):
    def load(self):
        train, val = toy.split_keys(0)
        return [ToolTask(ToyData(prompt=key, answer=toy.example(toy.tool_digits(key))[1]), self.config.task)
                for key in (train if self.config.split == "train" else val)]


class ToolEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()


class ToolEnv(vf.Env[ToolEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as interaction:
            segment = await interaction.turn()
            if self.taskset.config.fail:
                raise RuntimeError("the environment failed on purpose")
            while not segment.terminated:
                call = CALL.search(segment.last_reply)
                if call is None:
                    break  # the answer: the task's reward scores it
                try:
                    request = json.loads(call.group(1))
                    text = toy.lookup(**request["arguments"]) if request.get("name") == "lookup" else \
                        "Error: no such tool"
                except Exception as e:  # noqa: BLE001 - the model's malformed call is answered, as our tool loop does
                    text = f"Error: {e}"
                segment = await interaction.turn([vf.ToolMessage(tool_call_id="lookup", name="lookup", content=text)])


__all__ = ["ToolTaskset", "ToolEnv"]
