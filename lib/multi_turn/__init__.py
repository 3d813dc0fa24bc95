"""Multi-turn rollouts with tools (``--multi_turn.tools path.py:name``): the policy calls tools over several turns in
the same SPMD loop, one batched generate per turn on every rank.

- ``tools.py``: loading tools, their schemas, running a call in a worker process;
- ``parsers.py``: tool calls out of a turn's text, by format (hermes, llama3_json);
- ``render.py``: the observation tokens that follow a turn, from the chat template;
- ``loop.py``: the rollout, token in, token out (``response_mask`` 1 on sampled tokens only).
"""

from __future__ import annotations

from typing import Any

from lib.multi_turn.parsers import PARSERS


def enabled(cfg: Any) -> bool:
    """``cfg``: the whole Config."""
    return bool(cfg.multi_turn.tools)


def config_problems(cfg: Any) -> list[str]:
    """What keeps the multi_turn section's values from running (each naming the fix); nothing when it is off."""
    m, r = cfg.multi_turn, cfg.rollout
    if not enabled(cfg):
        return []

    problems = []
    if m.format not in PARSERS:
        problems.append(f"multi_turn.format={m.format!r}; use one of {sorted(PARSERS)}")
    for name, low in (("max_turns", 1), ("max_tool_calls_per_turn", 1), ("tool_workers", 1),
                      ("max_tokens_per_turn", 0), ("max_response_tokens", 0), ("tool_response_max_tokens", 0)):
        if getattr(m, name) < low:
            problems.append(f"multi_turn.{name}={getattr(m, name)} must be >= {low}")
    if m.tool_timeout_s <= 0:
        problems.append(f"multi_turn.tool_timeout_s={m.tool_timeout_s} must be > 0")
    if m.max_response_tokens > r.max_response_length:
        problems.append(f"multi_turn.max_response_tokens={m.max_response_tokens} exceeds rollout.max_response_length="
                        f"{r.max_response_length} (the row's width after the prompt); raise that or lower this")
    if not cfg.data.apply_chat_template:
        problems.append("multi-turn rollouts render tool observations with the chat template: turn "
                        "data.apply_chat_template on")
    return problems  # the tools themselves are loaded and checked with the data (lib.inputs.check_inputs)
