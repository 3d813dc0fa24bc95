"""torchrun entry for the zoo's end-to-end runs (tests/test_model_zoo.py): train_grpo.py's main for each model in
turn, in the same ranks and the same default process group (each run makes its own meshes in it). Creating the
default group again in the same ranks races on the rendezvous keys (a rank can read its peer's address from
the previous group: "Connection refused"), so the runs' teardown leaves it up and the driver ends it.

    torchrun --nproc-per-node 2 tests/zoo_driver.py ZOO_ROOT OUT_ROOT NAME [NAME ...] -- [train_grpo flags]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import train_grpo  # noqa: E402
from tests import zoo  # noqa: E402


def main(argv: list[str]) -> None:
    split = argv.index("--")
    (zoo_root, out_root, *names), flags = argv[:split], argv[split + 1:]
    train, val = zoo.write_data(zoo_root)
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
    for name in names:
        train_grpo.main(["--actor.model.path", os.path.join(zoo_root, name), "--data.train_files", train,
                         "--data.val_files", val, "--trainer.output_root", out_root, "--trainer.run_name", name,
                         "--data.max_prompt_length", "128", "--rollout.max_response_length", "8",
                         "--trainer.total_steps", "2", "--trainer.val_every", "0", "--trainer.train_batch_size", "4",
                         "--rollout.n", "2", "--actor.mini_batch_size", "8",
                         "--actor.batching.micro_batch_size_per_rank", "4", *flags])
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
