"""An agent written with the OpenAI Agents SDK (``pip install openai-agents``), for the toy tool task: a function tool
and the SDK's own loop. The run serves the model at ``base_url``; the SDK's chat-completions model talks to it.

    bash launch.sh train_grpo.py --config configs/tiny_cpu_grpo_agent.yaml \
        --agent.entry examples/agent_programs/toy_tool_agents_sdk.py:agent
"""

import ssl

import httpx
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from lib import toy

set_tracing_disabled(True)  # no trace upload: the run has no network
TLS = ssl.create_default_context()  # done once: a new client's own TLS setup costs ~50 ms


@function_tool
def lookup(key: str) -> str:
    """Look up the digits stored under a key.

    Args:
        key: The four-digit key from the question.
    """
    return toy.lookup(key)


async def agent(row: dict, base_url: str) -> None:
    async with httpx.AsyncClient(verify=TLS, timeout=600) as http:
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
        bot = Agent(name="toy", tools=[lookup], model=model, model_settings=ModelSettings(max_tokens=32))
        try:
            await Runner.run(bot, row["prompt"][-1]["content"], max_turns=3)
        except MaxTurnsExceeded:  # still calling tools after 3 turns: its last reply is scored as it is
            pass
    return None
