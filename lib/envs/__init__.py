"""Environments and task libraries from the ecosystem, trained in the same SPMD loop (no controller: each rank runs
its own samples' episodes).

- ``reasoning_gym.py``: reasoning-gym's procedural tasks as prompt data (``--data.train_files reasoning_gym:TASK``),
  scored by the library's own answer check (lib/rewards/reasoning_gym.py).
"""
