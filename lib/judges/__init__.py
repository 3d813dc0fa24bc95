"""LLM judges as rewards (issue 43): a generative model reads the prompt, the response and the reference answer
and writes a verdict, which becomes the sample's reward.

- ``parse.py``: a verdict's text -> a score in the reward range, or the reason there is none (unparseable,
  truncated by the judge's token limit);
- ``remote.py``: an OpenAI-compatible endpoint (a vLLM or SGLang server, a hosted API): requests in flight capped,
  timeouts, a deadline per step, retries with jittered backoff on 429, 5xx and time-outs, a cache, a token budget.

A sample the judge could not score is masked from the update and counted, never rewarded 0.
"""
