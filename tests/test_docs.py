"""The front page and the docs: the README fits a front page, every page starts from a command, every link and picture
resolves, and the references the code can produce (docs/config.md's generated block: every config key, the
presets, the tested vLLM range, the model families) are what the code produces now. The command lines of every page
are parsed in tests/test_recipes.py."""

import os
import re

from lib import config_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))


def _read(path: str) -> str:
    return open(os.path.join(ROOT, path)).read()


def test_the_generated_config_reference_is_the_codes():
    """docs/config.md's block equals what lib.config_doc makes from the config classes (a key added, renamed, given
    another default or help line without `python -m lib.config_doc --write` fails here)."""
    page = _read("docs/config.md")
    block = page[page.index(config_doc.BEGIN):page.index(config_doc.END) + len(config_doc.END)]
    assert block == config_doc.render(), "docs/config.md is stale: run python -m lib.config_doc --write"
    rows = config_doc.config_rows()
    assert len(rows) > 150 and all(f"| `{key}` |" in block for key, *_ in rows)
    for needed in ("actor.model.fused_head", "rollout.routing_replay", "judge.weight", "trainer.total_steps"):
        assert f"`{needed}`" in block, needed


def test_the_reference_catches_a_key_the_page_lacks(monkeypatch):
    """The check can fail: a config key the page does not hold makes the generated block differ."""
    rows = config_doc.config_rows()
    monkeypatch.setattr(config_doc, "config_rows", lambda: rows + [("trainer.new_key", "int", "`0`", "new")])
    page = _read("docs/config.md")
    assert page[page.index(config_doc.BEGIN):page.index(config_doc.END) + len(config_doc.END)] != config_doc.render()


def test_the_readme_is_a_front_page():
    """At most ~250 lines; it reaches the commands for a user's model, GPUs, reward function and resume, and links
    every page of docs/."""
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 250, len(readme.splitlines())
    for needed in ("bash launch.sh", "bash test.sh", "torchrun --nproc-per-node", "sbatch", "--reward.custom_fn",
                   "def score(", "Resume", "USE_CURRENT_ENV=1", "WHEELS="):
        assert needed in readme, needed
    for page in PAGES:
        assert f"docs/{page}" in readme, page


def test_every_page_starts_from_a_command_and_every_link_resolves():
    for page in ["README.md", *(f"docs/{p}" for p in PAGES)]:
        text = _read(page)
        head = "\n".join(text.splitlines()[:15])
        assert text.startswith("# ") and "```bash" in head, f"{page}: no command near its top"
        folder = os.path.dirname(os.path.join(ROOT, page))
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert os.path.exists(os.path.join(folder, target)), f"{page}: {target} does not exist"
