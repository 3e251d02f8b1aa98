"""A second OS process for test_host_tier: maps the host slab by name and obeys
line commands on stdin — ``write OFFSET NBYTES SEED`` fills a slot with a seeded
pattern, ``check OFFSET NBYTES SEED`` verifies one — answering ``ok`` or ``bad``."""

import sys

import torch

from kvstore.tiers.host import SharedSlab
from kvstore.tiers.slab import Slot


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    slab = SharedSlab.attach(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        command, offset, nbytes, seed = line.split()
        view = slab.view(Slot(int(offset), int(nbytes)))
        expected = pattern(int(nbytes), int(seed))
        if command == "write":
            view.copy_(expected)
            print("ok", flush=True)
        else:
            print("ok" if torch.equal(view, expected) else "bad", flush=True)
    slab.close()


if __name__ == "__main__":
    main()
