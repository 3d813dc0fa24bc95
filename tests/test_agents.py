"""The OpenAI-compatible endpoint (lib/agents/endpoint.py) against the openai SDK's own client, on the toy tool task's
warm-started policy (a Qwen2 shape with a chat template and a tool call it learned): agents in threads, the rank's
main thread serving the HF engine. Every call's tokens are the ones the engine sampled, and their log-probs are the
trainer's (the canary, fp32)."""

import json
import threading

import pytest
import torch

from tests.conftest import shared_assets

for _module in ("openai", "uvicorn", "starlette"):  # test.sh installs them (the envs-test extra)
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install -e '.[envs-test]' (test.sh does)")

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up the digits stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


@pytest.fixture(scope="module")
def served(shared_assets_dir):
    """The toy tool policy in an awake HF engine (temperature 1, 48 tokens a response), an endpoint over it, and the
    trainer's model to recompute log-probs."""
    from transformers import AutoModelForCausalLM

    from lib import toy
    from lib.agents.endpoint import Endpoint
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.judges.local import checkpoint_tensors
    from lib.models import load_config, load_tokenizer, stop_token_ids
    from lib.multi_turn.parsers import parse_hermes

    path = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))["model"]
    tokenizer = load_tokenizer(path)
    eos = stop_token_ids(path, tokenizer)
    engine = HFEngine(load_config(path), torch.device("cpu"), tokenizer.pad_token_id, eos,
                      SamplingConfig(temperature=1.0, max_new_tokens=48, seed=3), dtype=torch.float32)
    engine.wake_up()
    engine.load_weights(checkpoint_tensors(path))
    engine.finish_sync()
    endpoint = Endpoint(tokenizer, parse_hermes, temperature=1.0, top_p=1.0, max_prompt=128, max_response=128,
                        model_name="toy-tool")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield endpoint, engine, tokenizer, model
    endpoint.close()


def _serve(endpoint, engine, agents):
    """Run ``agents`` ({episode: function}) in threads of their own while this thread serves the engine in rounds;
    returns {episode: what its function returned}."""
    out, errors = {}, []

    def run(name, work):
        try:
            out[name] = work()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = {name: threading.Thread(target=run, args=(name, work)) for name, work in agents.items()}
    for t in threads.values():
        t.start()
    endpoint.serve(engine, lambda: [name for name, t in threads.items() if t.is_alive()], key=0)
    for t in threads.values():
        t.join()
    if errors:
        raise errors[0]
    return out


def _logps(model, ids, start):
    """The trainer's log-probs (temperature 1) of ids[start:] given what comes before."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[start - 1:].tolist()


def test_tool_calling_agents_of_the_openai_sdk_are_batched_and_every_token_kept(served):
    """Eight agents of the openai SDK at once, each a tool loop of two calls (ask; run the lookup it called, or else
    say "once more"; ask again with the history passed back): their calls go to the engine in two rounds of eight; each reply's text and
    usage are the kept ids'; the second call continues the first's ids exactly (never re-tokenised from text); the
    kept log-probs are the trainer's own to fp32 noise (at most 2.4e-6 measured: batched and padded, against one
    sequence)."""
    import openai

    from lib import toy

    endpoint, engine, tokenizer, model = served
    keys = ["1234", "9876", "5050", "0001", "4321", "7777", "2468", "1357"]
    before = len(endpoint.batches)

    def agent(i, key):
        client = openai.OpenAI(base_url=endpoint.base_url(f"tools-{i}"), api_key="none", max_retries=0)
        messages = [{"role": "user", "content": key}]
        replies = []
        for _ in range(2):  # a tool's answer, or else a user's next message: the history passed back either way
            r = client.chat.completions.create(model="toy-tool", messages=messages, tools=TOOLS, max_tokens=48)
            replies.append(r)
            message = r.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                messages.append({"role": "user", "content": "once more"})
            for call in message.tool_calls or []:
                args = json.loads(call.function.arguments)
                try:
                    result = toy.lookup(str(args.get("key", "")))
                except ValueError as e:
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return replies

    out = _serve(endpoint, engine, {f"tools-{i}": lambda i=i, k=k: agent(i, k) for i, k in enumerate(keys)})
    results = [out[f"tools-{i}"] for i in range(len(keys))]
    assert all(results), results
    # two rounds of all eight agents' calls: a round waits for every live agent's request
    assert endpoint.batches[before:] == [len(keys), len(keys)], endpoint.batches[before:]
    continued, tool_replies = 0, 0
    for i, (key, replies) in enumerate(zip(keys, results)):
        calls = endpoint.calls[f"tools-{i}"]
        assert len(calls) == len(replies)
        first = tokenizer.apply_chat_template([{"role": "user", "content": key}], add_generation_prompt=True,
                                              tokenize=False)
        assert calls[0].prompt_ids == tokenizer(first, add_special_tokens=False)["input_ids"]
        for call, reply in zip(calls, replies):
            assert reply.usage.prompt_tokens == len(call.prompt_ids)
            assert reply.usage.completion_tokens == len(call.ids)
            message = reply.choices[0].message
            text = tokenizer.decode(call.ids[:-1] if call.stopped else call.ids, skip_special_tokens=True)
            if message.tool_calls:
                assert reply.choices[0].finish_reason == "tool_calls"
                assert [c.function.name for c in message.tool_calls] == ["lookup"] and "<tool_call>" in text
                tool_replies += 1
            else:
                assert message.content == text
            seq = call.prompt_ids + call.ids
            diff = max(abs(a - b) for a, b in zip(call.logps, _logps(model, seq, len(call.prompt_ids))))
            assert diff < 1e-4, diff  # the canary on this path
        for a, b in zip(calls, calls[1:]):  # the history passed back unchanged: one sequence of the model's ids
            assert b.extends and b.prompt_ids[:len(a.prompt_ids) + len(a.ids)] == a.prompt_ids + a.ids
            continued += 1
    assert continued == len(keys), continued
    # the warm-started policy calls its tool in most episodes (5 of 8 first replies here)
    assert tool_replies >= 1, tool_replies


def test_streaming_usage_completions_models_and_refusals_as_openai_servers_answer(served):
    """Streaming gives the same reply as events (content, finish reason, usage last); /completions takes a string;
    /models names the model; a rewritten history is rendered whole (its call stands alone); what the endpoint does not
    take is refused with OpenAI's error body, before the engine."""
    import openai

    endpoint, engine, tokenizer, _ = served

    def work():
        client = openai.OpenAI(base_url=endpoint.base_url("misc"), api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="toy-tool", messages=[{"role": "user", "content": "3141"}],
                                                max_tokens=24, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        completion = client.completions.create(model="toy-tool", prompt="2718", max_tokens=8)
        models = [m.id for m in client.models.list().data]
        # a history the agent rewrote (its own words for the assistant's turn): rendered whole, not continued
        first = client.chat.completions.create(model="toy-tool", messages=[{"role": "user", "content": "5555"}],
                                               max_tokens=8)
        rewritten = [{"role": "user", "content": "5555"},
                     {"role": "assistant", "content": (first.choices[0].message.content or "") + " (summarised)"},
                     {"role": "user", "content": "again"}]
        client.chat.completions.create(model="toy-tool", messages=rewritten, max_tokens=8)
        refused = {}
        for name, kwargs in (("n", {"n": 2}), ("temperature", {"temperature": 0.5}),
                             ("tool_choice", {"tools": TOOLS, "tool_choice": "required"})):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="toy-tool", messages=[{"role": "user", "content": "1"}],
                                               **kwargs)
            refused[name] = e.value.response.json()["error"]
        return chunks, completion, models, refused, rewritten

    calls_before = len(endpoint.calls["misc"])
    chunks, completion, models, refused, rewritten = _serve(endpoint, engine, {"misc": work})["misc"]
    # the refused requests never reached the engine
    stream_call, completion_call, _, again = endpoint.calls["misc"][calls_before:]
    assert not again.extends and again.prompt_ids == tokenizer(tokenizer.apply_chat_template(
        rewritten, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(stream_call.ids[:-1] if stream_call.stopped else stream_call.ids,
                                    skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(stream_call.ids) and not chunks[-1].choices
    assert completion_call.prompt_ids == tokenizer("2718", add_special_tokens=False)["input_ids"]
    assert completion.usage.completion_tokens == len(completion_call.ids) <= 8
    assert models == ["toy-tool"]
    for name, error in refused.items():
        assert error["type"] == "invalid_request_error" and error["param"] == name, error
        assert error["code"] == "unsupported_value" and name in error["message"], error
