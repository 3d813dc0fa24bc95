"""The rollout viewer (lib/view): the values it reads from a run folder, without a browser; then the page itself in
headless Chromium (Debian's chromium and chromium-driver, installed with apt-get where missing and the test runs as
root; elsewhere the browser tests skip, saying why) on a short default run while it is in progress and after, and on
a multi-turn episode's samples. The page's screenshot is kept in test-artifacts/ (TEST_ARTIFACTS names another
folder)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lib import toy
from lib.samples import store
from lib.view import read
from tests.conftest import shared_assets
from tests.helpers import apt_install, forked_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("chromium", "chromium-driver")
WAIT_S = 300  # a safety net for a hang: every wait below ends on the state it waits for


def _row(**over):
    """A sample's record as the run writes it (store.SCHEMA), four response tokens."""
    r = {"step": 1, "uid": "0-7", "sample": 0, "episode": None, "data_source": "toy", "prompt": "p",
         "response": "abc", "reward": 1.0, "reward_terms": None, "advantage": 0.5, "length": 4,
         "response_tokens": 4, "finish": "stop", "turns": None, "images": [], "prompt_ids": [1, 2],
         "response_ids": [5, 6, 7, 8], "sampled_mask": [True] * 4, "loss_mask": [True, True, True, False],
         "engine_logp": [-1.0, -2.0, -0.5, -0.25], "trainer_logp": [-1.5, -2.0, -0.25, -1.0],
         "entropy": [0.1, 0.2, 0.3, 0.4], "advantages": [0.5, 0.5, 0.5, 0.0]}
    r.update(over)
    return r


def test_metrics_are_read_as_they_grow_and_again_when_a_resumed_run_rewrites_them(tmp_path):
    m = read.Metrics(str(tmp_path))
    assert not m.update() and m.rows == []  # no file yet: a run not started
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.25}\n{"step": 2, "reward/mean": 0.5}\n{"step": 3, "rew')
    assert m.update() and [r["step"] for r in m.rows] == [1, 2]  # the last line is not whole yet
    assert not m.update()
    with open(path, "a") as f:
        f.write('ard/mean": 0.75}\n')
    assert m.update() and m.curves(["reward/mean", "val/mean@1"]) == {"reward/mean": [(1, .25), (2, .5), (3, .75)]}
    path.write_text('{"step": 1, "reward/mean": 0.25}\n')  # a resume to step 1 cut the file
    assert m.update() and [r["step"] for r in m.rows] == [1]
    with open(path, "a") as f:  # step 2 again, and a row logged twice for one step: the last wins
        f.write('{"step": 2, "reward/mean": 0.125}\n{"step": 2, "reward/mean": 0.375, "val/mean@1": NaN}\n')
    assert m.update() and m.curves(["reward/mean", "val/mean@1"]) == {"reward/mean": [(1, .25), (2, .375)]}


def test_a_samples_values_token_by_token_and_the_tables_filter():
    r = _row(sampled_mask=[True, True, False, True])  # the third token: an observation
    assert read.per_token(r, "logp_diff") == [0.5, 0.0, None, 0.75]
    assert read.per_token(r, "advantage") == [0.5, 0.5, None, 0.0]
    assert read.per_token(_row(trainer_logp=None, entropy=None), "entropy") == [None] * 4  # a critic's warm-up step
    assert read.loss_mean(_row(), "logp_diff") == pytest.approx((0.5 + 0 + 0.25) / 3)  # the loss's tokens only
    texts, scale = read.tokens_html(["a", "<b>", "\n", "d"], read.per_token(r, "advantage"), "advantage")
    assert scale == 0.5 and texts.count('class="tok"') == 3 and texts.count('class="tok obs"') == 1
    assert "&lt;b&gt;" in texts and "rgba(34,160,70,0.850)" in texts and "rgba(34,160,70,0.000)" in texts
    assert read.colour(-0.25, 0.5, True) == "rgba(215,40,60,0.425)" and read.colour(1, 2, False) == "rgba(245,140,0,0.425)"
    samples = [dict(_row(reward=v, uid=f"0-{i}", response=t), id=i) for i, (v, t) in enumerate(
        [(1.0, "x"), (0.0, "y"), (None, "xy"), (0.5, "Xz"), (0.0, "y" * 200 + "needle")])]
    rows = read.table_rows(samples)
    assert [r["id"] for r in read.keep(rows, samples, reward_min=0.5)] == [0, 3]
    assert [r["id"] for r in read.keep(rows, samples, reward_max=0.5)] == [1, 3, 4]  # a masked one is outside any
    assert [r["id"] for r in read.keep(rows, samples, text="x")] == [0, 2, 3]
    assert [r["id"] for r in read.keep(rows, samples, 0.0, 0.5, "x")] == [3]
    assert [r["id"] for r in read.keep(rows, samples, text="NEEDLE")] == [4]  # past what the table shows
    assert rows[0]["logp_diff"] == pytest.approx(0.25)


def test_a_tokens_text_is_the_responses_text(shared_assets_dir, tmp_path):
    """With the run's tokenizer (the toy task's: kept beside the samples), the pieces make the decoded text; without
    one the ids are shown."""
    from transformers import AutoTokenizer

    model = toy.prepare(str(shared_assets(shared_assets_dir, "toy_assets")))["model"]
    assert read.tokenizer(str(tmp_path)) is None
    store.write_tokenizer(str(tmp_path), AutoTokenizer.from_pretrained(model))
    tok = read.tokenizer(str(tmp_path))
    ids = tok("3,1,4 -> 9,2", add_special_tokens=False)["input_ids"]
    assert "".join(read.pieces(tok, ids)) == tok.decode(ids) and len(read.pieces(tok, ids)) == len(ids)
    assert read.pieces(None, [5, 6]) == ["[5]", "[6]"]


def test_a_path_that_is_no_run_folder_is_one_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lib.view", str(tmp_path / "no" / "such")], cwd=ROOT,
                         capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 1 and "is no run folder, nor is its parent" in out.stderr, out.stderr


# the page in a browser

def _browser_missing() -> str:
    return "" if shutil.which("chromium") and shutil.which("chromedriver") else apt_install(PACKAGES)


@pytest.fixture(scope="module")
def browser():
    why = _browser_missing()
    if why:
        pytest.skip(why)
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (bash test.sh adds it)")
    pytest.importorskip("nicegui", reason="nicegui is not installed (bash test.sh adds it: the view extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


def _viewer(run_path):
    """``python -m lib.view`` on a free port, once it answers; returns (process, address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # nicegui's own test mode, else
    log = open(os.path.join(os.path.dirname(str(run_path)), f"viewer_{port}.log"), "w")  # read by no one: not a pipe
    proc = subprocess.Popen([sys.executable, "-m", "lib.view", str(run_path), "--port", str(port)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        try:
            urllib.request.urlopen(url, timeout=5)
            return proc, url
        except OSError:
            assert time.monotonic() - t0 < WAIT_S, "the viewer did not answer"
            time.sleep(0.2)


def _until(driver, state, what):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def holds(d):
        try:
            return state(d)
        except StaleElementReferenceException:  # the page redrew what was read: read it again
            return False

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(holds, message=what)


def _text(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).text


def _cells(driver, column):
    """The shown rows' values of ``column`` (COLUMNS' order)."""
    from selenium.webdriver.common.by import By

    from lib.view.page import COLUMNS  # needs nicegui, an optional package (the tests above need none)

    k = [c["name"] for c in COLUMNS].index(column)
    return [tr.find_elements(By.CSS_SELECTOR, "td")[k].text
            for tr in driver.find_elements(By.CSS_SELECTOR, ".view-table tbody tr")]


def _artifact(driver, name):
    folder = os.environ.get("TEST_ARTIFACTS") or os.path.join(ROOT, "test-artifacts")
    os.makedirs(folder, exist_ok=True)
    driver.save_screenshot(os.path.join(folder, name))


@pytest.mark.slow
def test_the_page_follows_a_default_run_filters_its_samples_and_colours_their_tokens(browser, shared_assets_dir,
                                                                                   tmp_path):
    """The viewer opened before the run starts; the short default run (4 steps, samples at the default share) held at
    the end of its step 2: the page shows step 2 as the newest; the samples filtered by reward and sorted; a sample's
    tokens coloured by its advantages and then by its entropy, the values the step trained with (the file's); then the
    run goes on and the page follows it to its last step."""
    from selenium.webdriver.common.by import By

    digits = toy.prepare(str(shared_assets(shared_assets_dir, "toy_assets")))
    run = tmp_path / "run"
    viewer, url = _viewer(run)
    try:
        browser.get(url)
        _until(browser, lambda d: "waiting for the run's first step" in _text(d, ".view-status"), "the waiting page")
        marker = tmp_path / "paused"
        train = subprocess.Popen(
            forked_torchrun(2, os.path.join(ROOT, "train_grpo.py"), "--actor.model.path", digits["model"],
                            "--data.train_files", digits["train"], "--data.val_files", digits["val"],
                            "--trainer.output_root", str(tmp_path), "--trainer.run_name", "run",
                            "--trainer.total_steps", "4", "--trainer.val_every", "2"), cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                 "SPMD_RL_TEST_PAUSE": f"2:{marker}"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            t0 = time.monotonic()
            while not marker.exists():
                assert train.poll() is None, train.communicate()[0][-5000:]
                assert time.monotonic() - t0 < WAIT_S
                time.sleep(0.2)
            # held after step 2: the page shows it as the newest step, the curves to step 2
            _until(browser, lambda d: "2 steps with samples, metrics to step 2" in _text(d, ".view-status"), "step 2")
            rows = read.samples(str(run), 2)
            n = len(rows)
            assert n and _text(browser, ".view-step .q-field__native") == "2"
            _until(browser, lambda d: _text(d, ".view-count") == f"{n} of {n} samples of step 2", "step 2's table")
            # filtered by reward: the samples rewarded 1 or more, as many as the file has
            top = sum(1 for r in rows if r["reward"] is not None and r["reward"] >= 1)
            browser.find_element(By.CSS_SELECTOR, ".view-rmin input").send_keys("1")
            _until(browser, lambda d: _text(d, ".view-count") == f"{top} of {n} samples of step 2", "the filter")
            assert all(float(v) >= 1 for v in _cells(browser, "reward"))
            browser.find_element(By.CSS_SELECTOR, ".view-rmin input").send_keys("\b")
            _until(browser, lambda d: _text(d, ".view-count") == f"{n} of {n} samples of step 2", "the filter off")
            # sorted by reward (a click on its column's header)
            browser.find_element(By.XPATH, "//div[contains(@class,'view-table')]//th[contains(normalize-space(), 'reward')]").click()
            _until(browser, lambda d: [float(v) for v in _cells(d, "reward")] == sorted(
                round(r["reward"], 4) for r in rows)[:len(_cells(d, "reward"))], "the sort")  # as the table rounds
            # a sample with both signs of advantage in its group: its tokens coloured by its advantages
            pick = next(i for i, r in enumerate(rows) if r["advantage"])
            browser.find_element(By.CSS_SELECTOR, ".view-text input").send_keys(rows[pick]["uid"])
            _until(browser, lambda d: str(pick) in _cells(d, "id"), "the sample's group")
            row = next(tr for tr in browser.find_elements(By.CSS_SELECTOR, ".view-table tbody tr")
                       if tr.find_elements(By.CSS_SELECTOR, "td")[0].text == str(pick))
            row.click()
            _until(browser, lambda d: f"sample {pick}:" in _text(d, ".view-title"), "the sample's detail")

            def shown(key):
                spans = browser.find_elements(By.CSS_SELECTOR, ".view-tokens span.tok")
                return [(float(s.get_attribute("data-v")), s.value_of_css_property("background-color")) for s in spans]

            expect = [v for v, s in zip(rows[pick]["advantages"], rows[pick]["sampled_mask"]) if s]
            _until(browser, lambda d: len(shown("advantage")) == len(expect), "the tokens")
            assert [v for v, _ in shown("advantage")] == pytest.approx(expect, rel=1e-5)
            assert all(c != "rgba(0, 0, 0, 0)" for v, c in shown("advantage") if v)  # coloured where not 0
            browser.find_element(By.CSS_SELECTOR, ".view-colour").click()
            _until(browser, lambda d: d.find_elements(By.XPATH, "//div[contains(@class,'q-item')][contains(., "
                                                                "'entropy:')]"), "the colour's menu")
            browser.find_element(By.XPATH, "//div[contains(@class,'q-item')][contains(., 'entropy:')]").click()
            entropy = [v for v, s in zip(rows[pick]["entropy"], rows[pick]["sampled_mask"]) if s]
            _until(browser, lambda d: [v for v, _ in shown("entropy")] == pytest.approx(entropy, rel=1e-5),
                   "the tokens coloured by entropy")
            assert "the trainer's entropy" in _text(browser, ".view-legend")
            _artifact(browser, "viewer.png")
            # the run goes on: the page follows it to its last step
            (tmp_path / "paused.go").touch()
            out = train.communicate(timeout=WAIT_S)[0]
            assert train.returncode == 0, out[-5000:]
            assert f"python -m lib.view {run}" in out  # the run's last line says how to look at it
        finally:
            if train.poll() is None:
                train.send_signal(signal.SIGKILL)
        _until(browser, lambda d: "4 steps with samples, metrics to step 4" in _text(d, ".view-status"), "step 4")
        _until(browser, lambda d: _text(d, ".view-step .q-field__native") == "4", "the newest step followed")
    finally:
        viewer.kill()


@pytest.mark.slow
def test_the_page_shows_an_episodes_turns_as_a_conversation(browser, tmp_path):
    """A multi-turn episode's sample (its turns: the assistant's with a tool call, the tool's answer, the assistant's
    again) in a run folder without a tokenizer: the conversation in order, the tool call named, the ids shown."""
    from selenium.webdriver.common.by import By

    turns = [{"role": "assistant", "text": "<tool_call>", "tool_calls": [{"name": "add", "arguments": {"a": 2}}]},
             {"role": "observation", "text": "<tool_response>5</tool_response>"},
             {"role": "assistant", "text": "5", "tool_calls": []}]
    store.write_step(str(tmp_path), 3, [_row(step=3, turns=json.dumps(turns),
                                             sampled_mask=[True, False, False, True])])
    viewer, url = _viewer(tmp_path)
    try:
        browser.get(url)
        _until(browser, lambda d: _text(d, ".view-count") == "1 of 1 samples of step 3", "the step")
        browser.find_element(By.CSS_SELECTOR, ".view-table tbody tr").click()
        _until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".view-turn")) == 3, "the turns")
        said = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".view-turn")]
        assert "assistant" in said[0] and "add({'a': 2})" in said[0]
        assert "observation" in said[1] and "<tool_response>5</tool_response>" in said[1] and "5" in said[2]
        spans = browser.find_elements(By.CSS_SELECTOR, ".view-tokens span")
        assert [s.text for s in spans] == ["[5]", "[6]", "[7]", "[8]"]
        assert [s.get_attribute("class") for s in spans] == ["tok", "tok obs", "tok obs", "tok"]
        assert "no tokenizer in the run folder" in _text(browser, ".view-legend")
        _artifact(browser, "viewer_turns.png")
    finally:
        viewer.kill()
