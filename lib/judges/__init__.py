"""LLM judges as rewards (issue 43): a generative model reads the prompt, the response and the reference answer
and writes a verdict, which becomes the sample's reward.

- ``parse.py``: a verdict's text -> a score in the reward range, or the reason there is none (unparseable,
  truncated by the judge's token limit);
- ``base.py``: what every judge shares: the prompt from the template, the cache, verdicts and metrics;
- ``remote.py``: an OpenAI-compatible endpoint (a vLLM or SGLang server, a hosted API): requests in flight capped,
  timeouts, a deadline per step, retries with jittered backoff on 429, 5xx and time-outs, a cache, a token budget;
- ``local.py``: a judge model in the trainer's processes, taking turns with the policy's engine on the device;
- ``toy.py``: the toy task's judge, a tiny reasoning model trained offline to grade it exactly
  (``judge.path toy_judge``).

A sample the judge could not score is masked from the update and counted, never rewarded 0.
"""

from __future__ import annotations

import os
import string
from typing import Any

from lib.judges.base import Judge
from lib.judges.local import LocalJudge
from lib.judges.remote import RemoteJudge

DEFAULT_TEMPLATE = """You are grading a response to a question.

Question:
{question}

Reference answer (may be empty):
{reference}

Response:
{response}

Judge how correct and helpful the response is. Think briefly, then end with a line "Score: N", N an integer from 0
(wrong or useless) to 10 (fully correct and helpful)."""


def build(cfg: Any, trust_remote_code: bool = False) -> Judge | None:
    """The judge of the config's ``judge`` section (None without a url or a path): a remote endpoint, its key read
    from the environment variable the config names, or a judge model (not loaded yet: ``LocalJudge.start``).
    Raises ValueError naming the fix for what cannot work."""
    if not cfg.url and not cfg.path:
        return None
    if cfg.url and cfg.path:
        raise ValueError(f"judge.url={cfg.url!r} and judge.path={cfg.path!r} both name a judge; keep one (url: a "
                         f"served model, path: a judge model run beside the policy)")
    problems = []
    if cfg.url and not cfg.model:
        problems.append("judge.model is empty: name the model the endpoint serves")
    key = ""
    if cfg.url and cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            problems.append(f"judge.api_key_env={cfg.api_key_env}: that environment variable is not set; export it "
                            f"with the endpoint's key (keys never go in a config)")
    template = DEFAULT_TEMPLATE
    if cfg.template:
        try:
            template = open(cfg.template).read()
        except OSError as e:
            problems.append(f"judge.template={cfg.template!r} cannot be read ({e.strerror}); point it at a text file")
    try:
        template.format(question="", response="", reference="")
    except (KeyError, IndexError, ValueError) as e:
        problems.append(f"judge.template: fields are {{question}}, {{response}} and {{reference}} (double other braces "
                        f"as {{{{ and }}}}); it has {type(e).__name__}: {e}")
    else:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        if "response" not in fields:
            escaped = "{{response}}" in template
            problems.append("judge.template has no {response} field: the judge would never see what it grades"
                            + ("; it has {{response}}, which str.format renders as the text '{response}' (Jinja's "
                               "braces): write single braces, {response}" if escaped else ""))
    if cfg.weight < 0 or cfg.rule_weight < 0:
        problems.append(f"judge.weight={cfg.weight:g}, judge.rule_weight={cfg.rule_weight:g}: a negative weight "
                        f"trains the policy against that score; weights are >= 0 (for a judge that scores faults, ask "
                        f"it for a quality score in the template instead)")
    if cfg.weight == 0 and cfg.rule_weight == 0:
        problems.append("judge.weight and judge.rule_weight are both 0: every reward would be 0; give the judge a "
                        "weight")
    if not cfg.scale_min < cfg.scale_max:
        problems.append(f"judge.scale_min={cfg.scale_min} must be below judge.scale_max={cfg.scale_max}")
    for name in ("max_in_flight", "max_tokens"):
        if getattr(cfg, name) < 1:
            problems.append(f"judge.{name}={getattr(cfg, name)} must be >= 1")
    for name in ("timeout_s", "deadline_s"):
        if getattr(cfg, name) <= 0:
            problems.append(f"judge.{name}={getattr(cfg, name)} must be > 0")
    if problems:
        raise ValueError("; ".join(problems))
    if cfg.path:
        return LocalJudge(cfg, template, trust_remote_code)
    return RemoteJudge(cfg, template, key)
