"""Observation tokens: what the chat template puts between one assistant turn and the next.

The model's own tokens are never re-rendered (token in, token out). Only the tool messages are rendered, as the
difference between the chat template applied to a stand-in conversation with and without them:

    render(base)                                        = ... assistant SENTINEL <tail>
    render(base + tool messages, generation prompt)     = ... assistant SENTINEL <tail> <tool turns> <next prompt>

Everything after the stand-in assistant's content is the template's own: ``<tail>`` is how it closes an assistant
turn (Qwen: ``<|im_end|>\\n``), the rest is the observation. The model's turn ended with a stop token; where the tail
starts with that token's text, the rest of the tail (Qwen: ``\\n``) is the boundary we insert. Templates rewrite
earlier turns (Qwen3 strips past reasoning) only before the sentinel, which is why the stand-in is cut there and
not compared as a prefix.

Templates that refuse a tool message without an assistant tool call before it (gpt-oss) are rendered the other way:
the stand-in assistant turn carries the calls, and the observation is what the tool messages add after it (the
model's stop token, ``<|call|>`` there, is the last thing of the turn, so nothing is inserted before it).
"""

from __future__ import annotations

from typing import Any

SENTINEL = "SPMDRL-ASSISTANT-CONTENT"
PROBE = "SPMDRL-TOOL-OUTPUT"


class ObservationRenderer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None, role: str = "tool"):
        """``role``: the observations' (tool: tool answers; user: an environment's next message, lib/envs)."""
        self.tokenizer = tokenizer
        self.template = chat_template  # None: the tokenizer's own
        self._base = [{"role": "user", "content": "SPMDRL-USER"}, {"role": "assistant", "content": SENTINEL}]
        self.with_calls = False
        probe = [tool_message("f", PROBE) if role == "tool" else {"role": role, "content": PROBE}]
        try:  # tool messages after the assistant's content, where they show (Gemma-4's show only after a call)
            self.tail = self._after_sentinel(self._apply(self._base, False))
            if PROBE in self.observation_text(probe, ""):
                return
        except Exception:  # noqa: BLE001 - jinja's TemplateError, raise_exception in the template, or no sentinel
            pass
        if role != "tool":
            raise ValueError(f"the chat template does not render a {role} message after an assistant turn as given: "
                             f"an environment's observations cannot be rendered with it; give the model folder a "
                             f"template that does, or set env.observation_role tool")
        self.with_calls, self.tail = True, ""  # else after an assistant tool call
        try:
            shown = PROBE in self.observation_text(probe, "")  # its ValueErrors name what this way lacks
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the template refuses tool messages (Gemma-3's: roles alternate)
            raise ValueError(f"the chat template cannot render a tool message ({type(e).__name__}: {str(e)[:120]}): "
                             f"multi-turn tools need a template with a tool role; give the model folder such a "
                             f"chat_template.jinja, or train without multi_turn.tools") from None
        if not shown:
            raise ValueError("the chat template renders no tool message's content, after an assistant message or "
                             "after a tool call: multi-turn tools need a template that shows tool results; give "
                             "the model folder such a chat_template.jinja, or train without multi_turn.tools")

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"chat_template": self.template} if self.template else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **kwargs)

    @staticmethod
    def _after_sentinel(text: str) -> str:
        at = text.find(SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as given, so tool "
                             "observations cannot be rendered from it")
        return text[at + len(SENTINEL):]

    def boundary_text(self, stop_text: str) -> str:
        """What the template puts after an assistant turn that ended with ``stop_text`` (the decoded stop token;
        "" when the turn did not end on one) before the next message."""
        if stop_text and self.tail.startswith(stop_text):
            return self.tail[len(stop_text):]
        return self.tail

    def observation_text(self, messages: list[dict], stop_text: str) -> str:
        """The text between an assistant turn that ended with ``stop_text`` and the model's next turn: the boundary,
        the tool messages, the generation prompt."""
        if self.with_calls:
            calls = [{"type": "function", "function": {"name": m.get("name", "f"), "arguments": {}}} for m in messages]
            base = [self._base[0], {"role": "assistant", "content": "", "tool_calls": calls}]
            before, after = self._apply(base, False), self._apply(base + list(messages), True)
            if not after.startswith(before):
                raise ValueError("the chat template renders an assistant tool call differently once tool messages "
                                 "follow it; multi-turn rendering needs a template that does not")
            return after[len(before):]
        full = self._after_sentinel(self._apply(self._base + list(messages), True))
        if not full.startswith(self.tail):
            raise ValueError(f"the chat template closes an assistant turn differently when tool messages follow "
                             f"({full[:40]!r} vs {self.tail!r}); multi-turn rendering needs a template that does not")
        return self.boundary_text(stop_text) + full[len(self.tail):]

    def observation_ids(self, messages: list[dict], stop_text: str) -> list[int]:
        return self.tokenizer(self.observation_text(messages, stop_text), add_special_tokens=False)["input_ids"]


def tool_message(name: str, content: str) -> dict:
    """A tool's answer as a chat message (role tool; the templates that want a name or an id read these)."""
    return {"role": "tool", "name": name, "content": content}
