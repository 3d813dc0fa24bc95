"""tests/stream_report.py: a pytest session killed in the middle of a test leaves, in its stream file, the verdict of
every test that ended before, a failure's traceback with it (the GPU acceptance run's gpu-marked tests)."""

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = '''
import os, time, pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert "engine" == "trainer", "the cause, as pytest would print it at the end"

@pytest.mark.skip(reason="no such device here")
def test_skipped():
    pass

def test_hangs():
    time.sleep(3600)
'''


def test_a_killed_session_leaves_each_ended_tests_verdict_and_a_failures_cause(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    stream = tmp_path / "stream.txt"
    # the session's root is the sample's folder (else pytest picks one from where it runs: the test ids below then
    # carry a path; under CI's workers they did, and this test waited on a line that never came)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.stream_report",
                            "--rootdir", str(tmp_path), "--stream-report", str(stream), str(tmp_path / "test_sample.py")],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600  # a guard against a hang, not a time the test asserts
    try:
        while "started test_sample.py::test_hangs" not in (stream.read_text() if stream.exists() else ""):
            assert run.poll() is None, run.stdout.read().decode()  # a session that ended by itself: no hang reached
            assert time.monotonic() < deadline, stream.read_text() if stream.exists() else "no stream file"
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # as the acceptance run's stop ends it at the last: no summary printed
        run.wait()
    said = stream.read_text()
    assert "short test summary" not in run.stdout.read().decode()  # pytest's own report never came
    lines = said.splitlines()
    assert [ln.split()[:2] for ln in lines if ln.split()[:1] in (["passed"], ["FAILED"], ["skipped"])] == [
        ["passed", "test_sample.py::test_passes"], ["FAILED", "test_sample.py::test_fails"],
        ["skipped", "test_sample.py::test_skipped"]]
    assert "the cause, as pytest would print it at the end" in said and "AssertionError" in said
    assert "no such device here" in said and lines[-1] == "started test_sample.py::test_hangs"
