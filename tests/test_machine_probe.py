import re

from tests import machine_probe


def test_the_probe_says_the_machine_and_three_timed_workloads_in_one_line(capsys):
    line = machine_probe.main()
    assert capsys.readouterr().out == line + "\n"
    m = re.fullmatch(r"machine probe: (.+), (\d+) cores, load ([\d.]+); one core: python loop ([\d.]+) s, "
                     r"torch matmul ([\d.]+) s, import torch ([\d.]+) s", line)
    assert m, line
    assert int(m.group(2)) >= 1 and all(float(m.group(k)) > 0 for k in (4, 5, 6)), line
