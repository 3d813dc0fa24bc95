"""LLM judges (lib/judges): the verdict parser's table, and the remote judge against a fake OpenAI-compatible server on
localhost (its cap on requests in flight, the retry matrix, the deadline, the cache, the budget, the key probe)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lib.judges.parse import DEADLINE, ERROR, OK, OVER_BUDGET, TRUNCATED, UNPARSED, raw_score, verdict
from lib.judges.remote import Endpoint, RemoteJudge, Rubric

SCALE, REWARD = (0.0, 10.0), (0.0, 1.0)


@pytest.mark.parametrize("text, truncated, how, score, status", [
    ('{"score": 7, "why": "fine"}', False, "json", 0.7, OK),
    ('first {"score": 2} then {"reason": "x", "score": 9.5}', False, "json", 0.95, OK),
    ("so the answer is \\boxed{4}", False, "boxed", 0.4, OK),
    ("\\boxed{8/10}", False, "boxed", 0.8, OK),
    ("Reasoning...\nScore: 7", False, "score", 0.7, OK),
    ("**Score:** 6/10", False, "score", 0.6, OK),
    ("<think>maybe Score: 1? no</think>Score: 9", False, "auto", 0.9, OK),  # the thinking's number is not the verdict
    ("<think>Score: 3 ... still thinking", False, "auto", None, TRUNCATED),  # an unclosed block: no verdict yet
    ("Score: 7", True, "auto", None, TRUNCATED),  # cut at the judge's token limit: masked even with a number
    ("I cannot grade this.", False, "auto", None, UNPARSED),
    ('{"score": "high"}', False, "json", None, UNPARSED),
    ("Score: 11", False, "auto", None, UNPARSED),  # outside the judge's scale
    ("Score: 0", False, "auto", 0.0, OK),  # the lowest score is a score, not a failure
    ('{"score": true}', False, "json", None, UNPARSED),
])
def test_the_parser_reads_each_form_and_flags_what_is_not_a_score(text, truncated, how, score, status):
    v = verdict(text, truncated, how, "score", SCALE, REWARD)
    assert v.status == status and (v.score == pytest.approx(score) if score is not None else v.score is None), v


def test_auto_prefers_json_then_boxed_then_score_lines():
    assert raw_score('Score: 1 {"score": 5}') == 5 and raw_score("Score: 1 \\boxed{3}") == 3
    assert raw_score('{"rating": 4}', "json", "rating") == 4


class Server:
    """A fake /v1/chat/completions. The judge's answer is scripted by the prompt's text: a prompt holding a key of
    ``plan`` gets that key's statuses in turn (an int: that HTTP status; "hold": no answer until the test ends;
    "cut": a verdict cut by its token limit), then a verdict "Score: N" with N the length of the response line.
    Counts calls per prompt and the most requests in flight."""

    def __init__(self, key: str = "good"):
        self.plan: dict[str, list] = {}
        self.calls: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.key = key
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][0]["content"]
                with outer.lock:
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                    outer.calls[text] = outer.calls.get(text, 0) + 1
                    step = next((p.pop(0) for k, p in outer.plan.items() if k in text and p), None)
                try:
                    if self.headers.get("Authorization") != f"Bearer {outer.key}":
                        return self._send(401, {"error": "bad key"})
                    if step == "hold":
                        outer.release.wait()
                        return
                    if isinstance(step, int):
                        return self._send(step, {"error": f"scripted {step}"})
                    response = text.split("A: ")[1].split("\n")[0] if "A: " in text else ""
                    answer = {"message": {"content": f"Score: {len(response)}" if response else "OK"},
                              "finish_reason": "length" if step == "cut" else "stop"}
                    self._send(200, {"choices": [answer], "usage": {"total_tokens": 10}})
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


TEMPLATE = "Q: {question}\nA: {response}\nRef: {reference}\nGrade it."


def _judge(server, **settings) -> RemoteJudge:
    endpoint = Endpoint(server.url, "judge-model", api_key="good", backoff_s=0.001, **settings)
    return RemoteJudge(endpoint, Rubric(TEMPLATE, scale=(0, 10)))


def _items(*responses: str):
    return [("2+2?", r, "4") for r in responses]


def test_requests_in_flight_never_exceed_the_cap(server):
    judge = _judge(server, max_in_flight=3)
    verdicts, metrics = judge.score(_items(*(f"answer {i:02d}" for i in range(20))))
    assert [v.status for v in verdicts] == [OK] * 20 and 1 <= server.most_in_flight <= 3
    assert [v.score for v in verdicts] == [0.9] * 20 and metrics["judge/requests"] == 20


def test_429_500_and_time_outs_are_retried_and_other_4xx_are_not(server):
    server.plan = {"rate": [429, 429], "flaky": [500, 503], "slow": ["hold"], "bad": [400]}
    judge = _judge(server, timeout_s=3, max_retries=3)  # a held request times out; 3 s: any other one is back
    verdicts, metrics = judge.score(_items("rate", "flaky", "slow", "bad", "fine"))
    assert [v.status for v in verdicts] == [OK, OK, OK, ERROR, OK], verdicts
    calls = {k.split("A: ")[1].split("\n")[0]: n for k, n in server.calls.items()}
    assert calls == {"rate": 3, "flaky": 3, "slow": 2, "bad": 1, "fine": 1}
    assert metrics["judge/errors"] == 1 and metrics["judge/requests"] == 10


def test_a_request_out_of_retries_is_an_error_never_a_zero(server):
    server.plan = {"down": [500] * 10}
    verdicts, metrics = _judge(server, max_retries=2).score(_items("down"))
    assert verdicts[0].status == ERROR and verdicts[0].score is None and server.calls and metrics["judge/errors"] == 1


def test_a_slow_server_meets_the_deadline_and_its_samples_are_masked(server):
    server.plan = {"stuck": ["hold"] * 5}
    judge = _judge(server, timeout_s=60, deadline_s=3)  # the held request never answers; 3 s: the other one does
    verdicts, metrics = judge.score(_items("stuck", "quick"))
    assert [v.status for v in verdicts] == [DEADLINE, OK] and verdicts[0].score is None
    assert metrics["judge/deadline"] == 1


def test_a_duplicate_makes_one_call_and_a_repeat_none(server):
    judge = _judge(server)
    verdicts, metrics = judge.score(_items("same", "same", "other"))
    assert [v.score for v in verdicts] == [0.4, 0.4, 0.5] and metrics["judge/requests"] == 2
    assert metrics["judge/cache_hits"] == 1
    verdicts, metrics = judge.score(_items("same"))
    assert verdicts[0].score == 0.4 and metrics["judge/requests"] == 0 and metrics["judge/cache_hits"] == 1


def test_the_budget_stops_calls_and_the_usage_is_counted(server):
    judge = _judge(server, max_in_flight=1, budget_tokens=25)
    verdicts, metrics = judge.score(_items("a1", "a2", "a3", "a4", "a5"))
    assert [v.status for v in verdicts] == [OK, OK, OK, OVER_BUDGET, OVER_BUDGET]
    assert metrics["judge/tokens"] == 30 and judge.used_tokens == 30 and metrics["judge/over_budget"] == 2
    assert _judge(server).score(_items("a1"))[1]["judge/tokens"] == 10  # per judge: another one starts afresh


def test_a_verdict_cut_at_the_judges_token_limit_is_masked(server):
    server.plan = {"long": ["cut"]}
    verdicts, metrics = _judge(server).score(_items("long"))
    assert verdicts[0].status == TRUNCATED and verdicts[0].score is None and metrics["judge/parse_failures"] == 1


def test_a_wrong_key_or_url_is_one_clear_error_from_the_probe(server):
    RemoteJudge(Endpoint(server.url, "m", api_key="good"), Rubric(TEMPLATE)).probe()
    with pytest.raises(ValueError, match="refused the key .HTTP 401.: set the environment variable"):
        RemoteJudge(Endpoint(server.url, "m", api_key="wrong"), Rubric(TEMPLATE)).probe()
    with pytest.raises(ValueError, match="cannot be reached"):
        RemoteJudge(Endpoint("http://127.0.0.1:9/v1", "m", timeout_s=2), Rubric(TEMPLATE)).probe()
