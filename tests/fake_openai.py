"""A fake OpenAI-compatible ``/v1/chat/completions`` server on localhost, for the judge tests (tests/test_judges.py)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Listener(ThreadingHTTPServer):
    # the judge opens up to max_in_flight connections a rank at once: with the socket's default backlog of 5 most are
    # refused, and each comes back after a retry's backoff
    request_queue_size = 1024


class Server:
    """A fake /v1/chat/completions. The judge's answer is scripted by the prompt's text: a prompt holding a key of
    ``plan`` gets that key's statuses in turn (an int: that HTTP status; "hold": no answer until the test ends;
    "cut": a verdict cut by its token limit), then a verdict "Score: N" with N the length of the response line.
    Counts calls per prompt and the most requests in flight. ``grade(prompt text) -> str``: the verdict instead.
    A request with a JSON schema in ``response_format`` (guided decoding) gets ``{"<its one field>": N}``, or HTTP 400
    from a server made with ``guided=False``; the schemas asked for are kept in ``formats``.
    """

    def __init__(self, key: str = "good", grade=None, guided: bool = True):
        self.plan: dict[str, list] = {}
        self.calls: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.key, self.grade, self.guided = key, grade, guided
        self.formats: list[dict] = []
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
                    content = outer.grade(text) if outer.grade else f"Score: {len(response)}" if response else "OK"
                    schema = (body.get("response_format") or {}).get("json_schema")
                    if schema is not None:
                        if not outer.guided:
                            return self._send(400, {"error": "response_format json_schema is not supported"})
                        with outer.lock:
                            outer.formats.append(schema)
                        content = json.dumps({next(iter(schema["schema"]["properties"])): len(response)})
                    answer = {"message": {"content": content},
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

        self.httpd = _Listener(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
