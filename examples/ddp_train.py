"""DDP with torchrun: every rank asks cachekit for the same entry; one build serves them all.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py covers.csv

The CSV needs the columns img_path and label (``cachekit demo --csv covers.csv`` writes
one). The first rank to take the build lock decodes, the others join its build where they
bring cores it does not use, or else wait for it; then every rank maps the same file.
Nothing runs on rank 0 first, and no barrier is needed around the call. Each rank gives
cachekit its share of the host's cores (``workers``), so the ranks of one host split the
decoding, and each rank prints where its rows came from. See docs/ddp.md.
"""

import os
import sys

import pandas as pd
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import cachekit
from cachekit.dataset import EntryDataset

dist.init_process_group("gloo")  # "nccl" on GPUs; the cache is the same
rank, world = dist.get_rank(), dist.get_world_size()
share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["LOCAL_WORLD_SIZE"]))

frame = pd.read_csv(sys.argv[1])
entry = cachekit.Cache(workers=share).images(frame["img_path"], size=64)

decoded = torch.tensor([entry.rows_decoded])
dist.all_reduce(decoded)  # the rows every rank decoded, summed
print(f"rank {rank}/{world}: {entry.source}; decoded {entry.rows_decoded}, joined "
      f"{entry.rows_joined}, reused {entry.rows_reused} of {len(entry)} rows; "
      f"all ranks decoded {int(decoded)}", flush=True)

data = EntryDataset(entry, targets=frame["label"])
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
for images, labels in loader:
    pass  # the model's forward and backward pass go here
dist.destroy_process_group()
