"""Agents for tests/test_agents.py that behave in every way an agent can, by the episode's position in its rank's
rollout (the last number of its episode in its base URL, so that a prompt's 8 samples take all 8 ways): raise, outlive the time limit,
never call, send a request the endpoint refuses, rewrite their history (two rows), return a reward of their own,
return one that is not a number, or play the tool loop as a user's agent would."""

import ssl
import time

import httpx
from openai import OpenAI

from lib.rewards import load_object

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up the digits stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
PLAYS = load_object("examples/agent_programs/toy_tool_openai.py:agent", "the example agent")
TLS = ssl.create_default_context()  # once, as docs/agents.md advises (a client's own costs ~50 ms of CPU)
WAYS = ("raise", "sleep", "no_call", "refused", "rewrite", "own_reward", "bad_reward", "plays")


def agent(row, base_url):
    way = WAYS[int(base_url.rstrip("/").split("/")[-2].rsplit("-", 1)[-1]) % len(WAYS)]  # .../e/<rollout>-<i>/v1
    if way == "raise":
        raise KeyError("the agent's own bug")
    if way == "sleep":
        time.sleep(120)  # past agent.timeout_s: the episode fails; the thread is left
        return None
    if way == "no_call":
        return 0.5
    if way == "plays":  # as a user's agent would: the example's tool loop
        return PLAYS(row, base_url)
    with httpx.Client(verify=TLS, timeout=600) as http:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        messages = list(row["prompt"])
        ask = lambda **kw: client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,  # noqa: E731
                                                          max_tokens=24, **kw).choices[0].message
        if way == "refused":
            ask(temperature=0.5)  # raises BadRequestError: this run samples at temperature 1
        ask()
        if way == "rewrite":  # the agent's own summary of the model's turn: the next call starts a row of its own
            messages += [{"role": "assistant", "content": "I looked it up."}, {"role": "user", "content": "Answer."}]
            ask()
            return None
        return 1.0 if way == "own_reward" else "fine"
