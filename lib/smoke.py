"""A distributed smoke run: build the Topology, gather a DataProto, reduce a metric. `bash launch.sh` runs it
until the training scripts exist."""

import torch

from lib.dist import all_gather, init_topology, reduce_metrics
from lib.protocol import DataProto


def main() -> None:
    topo = init_topology()
    local = DataProto.from_dict({"x": torch.full((topo.rank + 1, 3), topo.rank)}, {"who": [f"rank{topo.rank}"] * (topo.rank + 1)})
    gathered = all_gather(local)
    metrics = reduce_metrics({"rows": len(local)}, op="sum")
    if topo.is_main:
        print(topo)
        print(gathered, "rows summed over ranks:", metrics["rows"])


if __name__ == "__main__":
    main()
