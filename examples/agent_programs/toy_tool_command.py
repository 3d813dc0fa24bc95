"""An agent as a command, in any language: this one uses Python's standard library alone (no SDK). The run starts it
once per sample with OPENAI_BASE_URL and OPENAI_API_KEY set and the data row as JSON on its standard input; the last
line it prints, if JSON (a number or a dict with "score"), is the reward, else the task's rule scores the last reply.

    bash launch.sh train_grpo.py --config configs/tiny_cpu_grpo_agent.yaml --agent.entry "" \
        --agent.command "python examples/agent_programs/toy_tool_command.py"
"""

import json
import os
import sys
import urllib.request

from lib.toy import lookup

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up the digits stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def chat(messages: list) -> dict:
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 32}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {
        "Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def main() -> None:
    row = json.load(sys.stdin)
    messages = list(row["prompt"])
    for _ in range(3):
        message = chat(messages)
        messages.append(message)
        if not message.get("tool_calls"):
            return
        for call in message["tool_calls"]:
            try:
                result = lookup(**json.loads(call["function"]["arguments"]))
            except (TypeError, ValueError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


if __name__ == "__main__":
    main()
