"""An agent written with the openai SDK alone, for the toy tool task (lib/toy.py, toy_tool): it asks the model, runs
the ``lookup`` tool the model calls, passes the answer back, and stops at a reply without a tool call. Nothing in it
knows about RL; the run serves the model at ``base_url`` and trains on the tokens of its calls.

    bash launch.sh train_grpo.py --config configs/tiny_cpu_grpo_agent.yaml
    # or: --agent.entry examples/agent_programs/toy_tool_openai.py:agent
"""

import json
import ssl

import httpx
from openai import OpenAI

from lib.toy import lookup

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up the digits stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
# the TLS setup that every new client does (~50 ms of CPU: the certificate store) done once for all episodes
TLS = ssl.create_default_context()


def agent(row: dict, base_url: str) -> None:
    """One episode: ``row`` is the data row (its ``prompt`` messages, ``ground_truth``, ...). Returns None: the
    task's rule scores the last reply (return a number to give the reward yourself)."""
    with httpx.Client(verify=TLS, timeout=600) as http:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        messages = list(row["prompt"])
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=32)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None
            for call in message.tool_calls:
                try:
                    result = lookup(**json.loads(call.function.arguments))
                except (TypeError, ValueError) as e:  # the model's call may be malformed: it reads the error
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
