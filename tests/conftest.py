import os

# One thread: ranks are forked from this process, and an OpenMP pool started before a fork can hang the
# children; with 8 ranks on 2 cores more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
