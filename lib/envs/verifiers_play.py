"""A verifiers 0.4 environment's turns, played in our turn loop (``--env.verifiers``): the environment's own
``Env.run(task, agents)`` drives the episode, and the seat it plays is the policy, token in, token out.

verifiers runs an episode as a coroutine that calls ``agents.<seat>.interaction(task)`` and then
``interaction.turn(message)`` once per turn (a game engine, a scripted user, a tool answered by the environment: the
control flow is the environment's). Here every seat is a stand-in whose ``turn`` hands the message to our loop and
waits for the policy's reply, sampled in the loop's batched generate with every other episode of the rank. So an
episode is a session of the same shape as an OpenEnv one (lib/envs/openenv.py's ``Session``):

- ``reset`` (the row's ``extra_info.verifiers``: environment id, taskset arguments, task index) starts the
  coroutine on the rank's event loop (one daemon thread) and answers at its first turn: the message it opens with, if
  any, which ends the prompt (a prompted task opens with a bare ``turn()``: nothing to add);
- ``step`` gives the coroutine the turn's text and answers at its next turn (its message, rendered with the role the
  environment gave it: a user message, or a tool message) or at its end (done, the reward);
- the loop's last turn of an episode (env.max_turns, a turn cut by its cap, the token budget) is marked, so the
  environment's next ``turn`` comes back ``terminated``, as verifiers' own limits end an exchange; the environment
  then ends, and its rewards score what was played. An episode the loop ends on an observation that does not fit
  ends the same way (``end``).

The reward is the played seat's trace reward (``Trace.reward``: its task's rewards, run when its interaction closes,
plus what ``Env.run`` and ``Env.finalize`` record). One seat plays: a second seat that takes turns, or an untrained
seat (another model's part, user-sim's user), fails the episode with the reason. Environments whose tasks need
tools served over MCP, or a container, are refused at start-up (``check``): a harness program runs those.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
from contextlib import asynccontextmanager
from typing import Any

from lib.envs.openenv import EnvFailure, Result
from lib.rewards.verifiers_score import append, library, opening_trace, tasks


@functools.lru_cache(maxsize=16)
def environment(env_id: str, arguments: str) -> Any:
    """The verifiers Env of ``env_id``'s taskset made with ``arguments`` (JSON): its own Env subclass where its package
    exports one, else verifiers' single-agent one."""
    vf = library()
    config = vf.resolve_env_config({"taskset": {"id": env_id, **json.loads(arguments)}})
    return vf.load_environment(config)


def check(env_id: str, arguments: dict) -> None:
    """Why ``env_id``'s episodes cannot be played here (ValueError), before training: an environment that does not
    load, tools served over MCP, a task that needs a container."""
    try:
        env = environment(env_id, json.dumps(arguments, sort_keys=True))
    except Exception as e:  # noqa: BLE001 - verifiers' own errors: a refused argument, an Env that does not build
        raise ValueError(f"verifiers environment {env_id!r} cannot be loaded to play its turns ({type(e).__name__}: "
                         f"{str(e)[:300]})") from None
    taskset = env.taskset
    task_type = type(taskset).task_type()
    if taskset.toolsets(taskset.config) or task_type.toolsets(taskset.config.task):
        raise ValueError(f"verifiers environment {env_id!r} serves its tools over MCP to a harness program; "
                         f"env.verifiers plays turns the environment's Env.run drives, not a harness's tool calls")
    if getattr(task_type, "NEEDS_CONTAINER", False):
        raise ValueError(f"verifiers environment {env_id!r}'s tasks need a container runtime, which env.verifiers "
                         f"does not start")


def message_dict(message: Any) -> dict:
    """A verifiers message as a chat message of ours: role and text (a tool message keeps its tool's name)."""
    m = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    content = m.get("content")
    if not isinstance(content, str):
        content = "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))
    out = {"role": m.get("role", "user"), "content": content}
    if out["role"] == "tool":
        out["name"] = m.get("name") or "environment"
    return out


class Bridge:
    """One rank's event loop for the environments' coroutines, on a daemon thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verifiers", daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)


class _Play:
    """The hand-over between one episode's coroutine and the loop: the coroutine's events (turn, end, error) on a
    queue the loop waits on, the loop's replies on a future the coroutine awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: queue.Queue = queue.Queue()
        self.reply: asyncio.Future | None = None
        self.ending = False  # the loop marked the last turn: the next turn() is terminated
        self.cut = False  # a turn came back terminated because of it
        self.seat: Any = None
        self.trace: Any = None

    async def ask(self, messages: list[dict]) -> str | None:
        """The policy's reply to ``messages`` (None: the loop ended the episode, no reply)."""
        self.reply = self.loop.create_future()
        self.events.put(("turn", messages))
        return await self.reply


class _Interaction:
    """verifiers' Interaction as the environment sees it: a live trace and ``turn``."""

    def __init__(self, task: Any, play: _Play, name: str):
        self.task, self.play = task, play
        self.over = self.closed = self.started = False
        self.trace = opening_trace(task, name=name)

    async def turn(self, message: Any = None) -> Any:
        vf = library()
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        self.started = True
        if self.play.ending:
            self.over = self.play.cut = True
            return vf.Segment(messages=[], terminated=True)
        given = [vf.UserMessage(content=message)] if isinstance(message, str) else list(message or [])
        typed = []
        for m in given:
            if isinstance(m, dict):
                role = m.get("role", "user")
                m = vf.ToolMessage(**{"tool_call_id": "", **m}) if role == "tool" else vf.UserMessage(**m)
            typed.append(m)
            append(self.trace, m)
        text = await self.play.ask([message_dict(m) for m in typed])
        if text is None:
            self.over = self.play.cut = True
            return vf.Segment(messages=[], terminated=True)
        reply = vf.AssistantMessage(content=text)
        append(self.trace, reply, sampled=True)
        return vf.Segment(messages=[reply])

    async def close(self) -> Any:
        """The task's rewards on the exchange (once)."""
        if not self.closed:
            self.closed = True
            await self.task.score(self.trace)
        return self.trace


class _Seat:
    """verifiers' Agent as an environment's run() sees it, its turns played by the policy."""

    def __init__(self, name: str, play: _Play):
        self.name, self.play = name, play
        self.trainable = True

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        play = self.play
        if not self.trainable:
            raise RuntimeError(f"the environment's seat {self.name!r} is not trained: another model plays it, which "
                               f"env.verifiers does not run (the policy plays one seat)")
        if play.seat is not None and play.seat is not self:
            raise RuntimeError(f"the environment's seats {play.seat.name!r} and {self.name!r} both take turns; "
                               f"env.verifiers trains one seat")
        play.seat = self
        interaction = _Interaction(task, play, self.name)
        play.trace = interaction.trace
        try:
            yield interaction
        finally:
            await interaction.close()

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on the task's prompt: one turn (a harness without tools answers once)."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace


async def _episode(env: Any, task: Any, play: _Play) -> None:
    vf = library()
    try:
        agents = vf.Agents(env.config, make=lambda name, spec: _Seat(name, play))
        record = vf.Episode(env=vf.EnvInfo(id=env.config.env_id),
                            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash))
        await env.setup(agents)
        await env.run(task, agents)
        if play.trace is None:
            raise RuntimeError("the environment's run() played no turn")
        record.traces = [play.trace]
        await env.finalize(task, record)
        play.events.put(("end", play.trace.reward, play.cut))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the environment's own failure: the episode's, reported to the loop
        play.events.put(("error", f"{type(e).__name__}: {str(e)[:300]}"))


class VerifiersSession:
    """One episode at a time of a verifiers environment, as the loop steps a session (see the module's doc)."""

    concludes = True  # an episode the loop ends early is ended here too (send "end"), for its reward

    def __init__(self, bridge: Bridge, timeout_s: float, action_field: str):
        self.bridge, self.timeout_s, self.action_field = bridge, timeout_s, action_field
        self.play: _Play | None = None
        self.future = None

    def _wait(self, kind: str) -> Result:
        try:
            event = self.play.events.get(timeout=self.timeout_s)
        except queue.Empty:
            raise EnvFailure("timeout", f"{kind} got no answer from the environment within {self.timeout_s:g} s") \
                from None
        if event[0] == "turn":
            return Result({}, None, False, messages=event[1])
        if event[0] == "end":
            return Result({}, event[1], True, cut=event[2])
        raise EnvFailure(kind, f"{kind}: the environment raised {event[1]}")

    def _hand(self, text: str | None) -> None:
        play = self.play
        if play is None or play.reply is None or play.reply.done():
            raise EnvFailure("step", "the environment is not waiting for a turn")
        reply, play.reply = play.reply, None
        self.bridge.loop.call_soon_threadsafe(reply.set_result, text)

    def send(self, kind: str, data: dict, last: bool = False) -> Result:
        if kind == "reset":
            self._stop()
            try:
                env = environment(data["env"], data.get("arguments", "{}"))
                task = tasks(data["env"], data.get("arguments", "{}"))[int(data["index"])]
            except Exception as e:  # noqa: BLE001 - a row that names no task of an installed environment
                raise EnvFailure("reset", f"reset: the row's verifiers task {data} cannot be loaded "
                                          f"({type(e).__name__}: {str(e)[:200]})") from None
            self.play = _Play(self.bridge.loop)
            self.future = asyncio.run_coroutine_threadsafe(_episode(env, task, self.play), self.bridge.loop)
            return self._wait("reset")
        if kind == "step":
            self.play.ending = last
            self._hand(data[self.action_field])
            return self._wait("step")
        if kind == "end":
            self.play.ending = True
            self._hand(None)
            return self._wait("step")
        raise ValueError(kind)

    def _stop(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.cancel()
        self.future = self.play = None

    def close(self) -> None:
        self._stop()
