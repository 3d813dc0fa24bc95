"""The viewer's page (NiceGUI): the run's curves, each step's samples in a table to filter and sort, a sample's
tokens coloured by a per-token value and its turns as a conversation. It reads the run folder again every
``POLL_S`` seconds, so a run in progress shows its new steps (and a resumed run its rewritten ones)."""

from __future__ import annotations

import os

from nicegui import ui

from lib.plot import GROUPS
from lib.view import read

POLL_S = 1.0
COLUMNS = [{"name": k, "label": k.replace("_", " "), "field": k, "sortable": k != "response",
            "align": "left" if k in ("uid", "source", "finish", "response") else "right",
            **({"style": "max-width: 18rem; overflow: hidden; text-overflow: ellipsis"} if k == "response" else {})}
           for k in ("id", "uid", "sample", "reward", "advantage", "length", "finish", "logp_diff", "entropy",
                     "source", "response")]


class View:
    """One browser tab's page and what it shows (each tab has its own)."""

    def __init__(self, run_path: str):
        self.run = run_path
        self.metrics = read.Metrics(run_path)
        self.steps: list[int] = []  # the steps with samples
        self.loaded: int | None = None  # which write of the shown step's file the table shows (read.version)
        self.rows: list[dict] = []  # the shown step's samples, whole
        self.table_all: list[dict] = []
        self.tok: object = None  # the run's tokenizer once read (False: none to read)
        self.shown: int | None = None  # the sample in the detail

    def build(self) -> None:
        with ui.header().classes("items-center bg-slate-800"):
            ui.label(os.path.basename(self.run) or self.run).classes("text-lg")
            self.status = ui.label().classes("view-status text-sm opacity-80")
        with ui.row().classes("w-full items-center"):
            self.group = ui.toggle(list(GROUPS), value="reward", on_change=self.draw_curves)
        self.chart = ui.echart({"xAxis": {"type": "value", "name": "step"}, "yAxis": {"type": "value", "scale": True},
                                "legend": {}, "tooltip": {"trigger": "axis"}, "series": [],
                                "animation": False}).classes("w-full h-64 view-curves")
        with ui.row().classes("w-full items-center gap-4"):
            self.step = ui.select([], label="step", on_change=self.load).classes("w-32 view-step")
            self.follow = ui.switch("follow the newest step", value=True).classes("view-follow")
            self.rmin = ui.number("reward from", on_change=self.filter).classes("w-32 view-rmin")
            self.rmax = ui.number("reward to", on_change=self.filter).classes("w-32 view-rmax")
            self.text = ui.input("text in the response or uid", on_change=self.filter).classes("w-64 view-text")
            self.count = ui.label().classes("view-count")
        with ui.row().classes("w-full no-wrap items-start"):
            self.table = ui.table(rows=[], columns=COLUMNS, row_key="id",
                                  pagination={"rowsPerPage": 25}).classes("w-3/5 view-table").props("dense")
            self.table.on("rowClick", lambda e: self.show(e.args[1]["id"]))
            self.detail()
        ui.timer(POLL_S, self.poll)
        self.poll()

    def detail(self) -> None:
        with ui.card().classes("w-2/5 sticky top-20 view-detail"):
            self.title = ui.label("click a sample to read it").classes("view-title")
            with ui.row().classes("items-center gap-4"):
                self.colour_by = ui.select({k: f"{k}: {v}" for k, v in read.VALUES.items()}, value="advantage",
                                           label="colour the tokens by", on_change=self.draw_tokens).classes(
                                               "w-96 view-colour")
                self.legend = ui.label().classes("view-legend text-sm")
            self.tokens = ui.html("").classes("view-tokens font-mono whitespace-pre-wrap")
            with ui.expansion("prompt").classes("w-full"):
                self.prompt = ui.label().classes("view-prompt font-mono whitespace-pre-wrap")
            self.terms = ui.label().classes("view-terms text-sm")
            self.conversation = ui.column().classes("w-full view-turns")

    def poll(self) -> None:
        if self.metrics.update():
            self.draw_curves()
        steps = list(read.store.steps(self.run))
        last = self.metrics.rows[-1]["step"] if self.metrics.rows else None
        self.status.set_text(f"{len(steps)} steps with samples, metrics to step {last}" if steps or last is not None
                             else f"waiting for the run's first step in {self.run}")
        if steps != self.steps:
            self.steps = steps
            if not steps:  # a fresh start in the same folder dropped every step
                self.rows, self.table_all = [], []
                self.filter()
                self.clear()
            self.step.set_options(steps)
            if steps and (self.follow.value or self.step.value not in steps) and self.step.value != steps[-1]:
                self.step.set_value(steps[-1])  # loads it
                return
        if self.step.value in steps and read.version(self.run, self.step.value) != self.loaded:
            self.load()  # written again since (a resumed run's step)

    def draw_curves(self) -> None:
        curves = self.metrics.curves(GROUPS[self.group.value])
        self.chart.options["series"] = [{"name": k, "type": "line", "data": pts, "showSymbol": len(pts) < 30}
                                        for k, pts in curves.items()]
        self.chart.update()

    def load(self) -> None:
        if self.step.value is None:
            return
        loaded = read.version(self.run, self.step.value)
        try:
            self.rows = read.samples(self.run, self.step.value)
        except FileNotFoundError:  # dropped by a resumed run: the next poll lists what is there
            return
        self.loaded = loaded
        self.table_all = read.table_rows(self.rows)
        self.filter()
        if self.shown is not None and self.shown < len(self.rows):
            self.show(self.shown)  # the same place in the new step's file
        else:
            self.clear()

    def clear(self) -> None:
        self.shown = None
        self.title.set_text("click a sample to read it")
        for label in (self.legend, self.prompt, self.terms):
            label.set_text("")
        self.tokens.set_content("")
        self.conversation.clear()

    def filter(self) -> None:
        kept = read.keep(self.table_all, self.rows, self.rmin.value, self.rmax.value, self.text.value or "")
        self.table.rows = kept
        self.table.update()
        self.count.set_text(f"{len(kept)} of {len(self.table_all)} samples of step {self.step.value}")

    def show(self, i: int) -> None:
        self.shown = i
        r = self.rows[i]
        reward = "masked (no verdict)" if r["reward"] is None else f"{r['reward']:.4g}"
        advantage = "-" if r["advantage"] is None else f"{r['advantage']:.4g}"
        self.title.set_text(f"step {r['step']}, sample {i}: group {r['uid']} #{r['sample']}, reward {reward}, "
                            f"advantage {advantage}, {r['length']} tokens sampled, finish {r['finish']}")
        self.prompt.set_text(r["prompt"])
        self.terms.set_text(f"reward terms: {r['reward_terms']}" if r["reward_terms"] else "")
        self.draw_tokens()
        self.conversation.clear()
        with self.conversation:
            for t in read.turns(r):
                calls = "".join(f"\n-> {c['name']}({c['arguments']})" for c in t.get("tool_calls") or [])
                ui.chat_message(t["text"] + calls, name=t["role"], sent=t["role"] == "assistant").classes("view-turn")

    def draw_tokens(self) -> None:
        if self.shown is None or self.shown >= len(self.rows):
            return
        if self.tok is None:
            self.tok = read.tokenizer(self.run) or False
        tok = self.tok or None
        r, key = self.rows[self.shown], self.colour_by.value
        content, scale = read.tokens_html(read.pieces(tok, r["response_ids"]), read.per_token(r, key), key)
        self.tokens.set_content(content)
        sign = "±" if key in read.SIGNED else "0 to "
        self.legend.set_text(f"{read.VALUES[key]}; full colour at {sign}{scale:.3g}"
                             + ("" if tok else "; token ids shown: no tokenizer in the run folder it can read"))


def serve(run_path: str, host: str, port: int) -> None:
    """The page at http://host:port/ until Ctrl-C: each browser tab gets its own View."""
    # a tab whose connection pauses (a laptop asleep, a busy machine) keeps its page for a minute (nicegui's 3 s
    # default dropped it on a loaded 2-core machine, and the page stopped following the run)
    ui.run(lambda: View(run_path).build(), host=host, port=port, title=f"run {os.path.basename(run_path)}",
           reload=False, show=False, show_welcome_message=False, uvicorn_logging_level="warning",
           reconnect_timeout=60.0)
