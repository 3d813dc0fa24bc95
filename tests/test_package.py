"""The package installs whole: the wheel that `pip install .` (not editable) builds holds every module of lib/.
A hand-written package list once left lib.multi_turn out, so a plain install had no multi-turn rollouts."""

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_holds_every_module_of_lib(tmp_path):
    # a copy of what the build reads: setuptools builds in the source folder, and a build/ left there would fill the
    # wheel from earlier builds
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "lib"), src / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), src)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                          "--wheel-dir", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = next(f for f in os.listdir(tmp_path) if f.endswith(".whl"))
    inside = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    modules = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "lib"))
                     for f in files if f.endswith(".py"))
    assert len(modules) > 40
    missing = [m for m in modules if m not in inside]
    assert not missing, missing
