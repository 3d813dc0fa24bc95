"""OpenEnv servers written with openenv-core for the tests (tests/test_envs.py), each an app for ``--env.app``:

- ``toy_app``: the embedded toy task (lib/toy.py) as an environment: reset takes the row's answer (its
  ``extra_info.env_reset``), or with ``show`` the digits to reverse, which it then shows as the first observation;
  one step, the action scored as the toy rule scores it.
- ``tool_app``: the toy tool task: a turn with a lookup call gets the digits behind the key as the observation, a
  turn without one is the answer, scored like the toy task.
- ``flaky_app``: failures on purpose, by the reset's ``fail``: raise at reset or step, a step that never answers,
  a reward that is not a number, an observation far too long.
"""

import json
import re
import time
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from lib import toy
from lib.rewards.builtin import toy as toy_score


class TextAction(Action):
    message: str


class TextObservation(Observation):
    text: str = ""


class ToyEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.answer = ""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, answer: str = "",
              show: str = "", **kwargs: Any) -> TextObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        if show:  # the task shown by the environment: the digits, the answer theirs backwards
            self.answer = ",".join(reversed(show.strip(",").split(","))) + ","
            return TextObservation(text=show)
        self.answer = answer
        return TextObservation(text="")

    def step(self, action: TextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        return TextObservation(text="", reward=toy_score(action.message, self.answer)["score"], done=True)

    @property
    def state(self) -> State:
        return self._state


CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class ToolEnv(ToyEnv):
    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, key: str = "",
              **kwargs: Any) -> TextObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.key = key
        self.answer = toy.example(toy.tool_digits(key))[1]
        return TextObservation(text="")

    def step(self, action: TextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        call = CALL.search(action.message)
        if call is None:
            return TextObservation(text="", reward=toy_score(action.message, self.answer)["score"], done=True)
        try:
            request = json.loads(call.group(1))
            text = toy.lookup(**request["arguments"]) if request.get("name") == "lookup" else "Error: no such tool"
        except Exception as e:  # noqa: BLE001 - the model's malformed call is answered, as our tool loop does
            text = f"Error: {e}"
        return TextObservation(text=text, reward=0.0, done=False)


class FlakyEnv(ToyEnv):
    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, fail: str = "", answer: str = "",
              **kwargs: Any) -> TextObservation:
        self.fail = fail
        if fail == "reset":
            raise RuntimeError("reset failed on purpose")
        return super().reset(seed, episode_id, answer=answer)

    def step(self, action: TextAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TextObservation:
        if self.fail == "step":
            raise RuntimeError("step failed on purpose")
        if self.fail == "hang":
            time.sleep(30)
        if self.fail == "nan":
            return TextObservation(text="", reward=float("nan"), done=True)
        if self.fail == "long":
            return TextObservation(text="9," * 400, reward=0.5, done=False)
        return super().step(action)


toy_app = create_app(ToyEnv, TextAction, TextObservation, max_concurrent_envs=1024)  # two ranks' 256 episodes each
tool_app = create_app(ToolEnv, TextAction, TextObservation, max_concurrent_envs=256)
flaky_app = create_app(FlakyEnv, TextAction, TextObservation, max_concurrent_envs=256)
single_app = create_app(ToyEnv, TextAction, TextObservation)  # openenv-core's default: one session at a time
