"""The zoo runs' reward (tests/zoo.py grpo_args: ``--reward.custom_fn`` with ``zoo.REWARD``), in a file of its
own: every reward worker of every such run (two a rank) imports the file it names, and tests/zoo.py imports torch
(~1.8 CPU-s a worker, more than a 2-step zoo run's own CPU); this file imports nothing."""


def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A score that differs between the samples of a prompt even for a random model (so that the advantages, and
    the update, are not zero): the response's characters hashed to [0, 1)."""
    return sum(map(ord, solution_str)) % 10 / 10
