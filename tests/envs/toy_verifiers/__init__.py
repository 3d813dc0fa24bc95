"""The embedded toy task (lib/toy.py) as a verifiers 0.4 environment, for the tests (tests/test_envs.py): the id
``toy-verifiers`` (this folder on the path), a taskset of the task's train or val split, one reward, the toy
rule's score of the last reply against the answer, and one metric, the exact match."""

import time

import verifiers.v1 as vf

from lib import toy
from lib.rewards.builtin import toy as toy_rule


class ToyData(vf.TaskData):
    answer: str


class ToyTask(vf.Task[ToyData]):
    @vf.reward(weight=1.0)
    async def reversed_digits(self, task: ToyData, trace: vf.Trace) -> float:
        return toy_rule(trace.last_reply or "", task.answer)["score"]

    @vf.metric
    async def exact(self, task: ToyData, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == task.answer)


class ToyConfig(vf.TasksetConfig):
    split: str = "train"
    load_s: float = 0.0  # seconds its load takes (the tests of a slow load)


class ToyTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self):
        time.sleep(self.config.load_s)
        train, val = toy.split_pairs(0)
        tasks = []
        for digits in train if self.config.split == "train" else val:
            question, answer = toy.example(digits)
            tasks.append(ToyTask(ToyData(prompt=question, answer=answer), self.config.task))
        return tasks


__all__ = ["ToyTaskset"]
