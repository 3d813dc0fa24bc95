"""Agents as users write them (issue 75): a program written against the OpenAI API, trained through an endpoint that
serves this rank's rollout engine and keeps every token it saw and sampled.

- ``endpoint``: the OpenAI-compatible endpoint (chat completions with tools and streaming, completions, models), its
  batching into the engine, the calls' tokens kept per episode.
"""
