"""The GPU acceptance run's rooms (bench/gpu_acceptance.py is its command):

- ``common``: the rows, the shapes, the model folders and what every check shares;
- ``engine_checks``: the checks that drive an engine and the trainer in one process (correctness, sleep and wake,
  LoRA across a sleep, rollout against bare vLLM, the update's throughput and its profile, the models of 2026);
- ``run_checks``: the checks that run ``train_grpo.py`` / ``train_ppo.py`` / TRL as a child, streamed to a log and
  stopped with SIGTERM so that a stopped run keeps its steps;
- ``schedule``: which check runs when (timed checks alone, the others in lanes), budgets and the stop;
- ``report``: the report, the overlap of timed checks, and the archive that comes back from the GPU machine.
"""
