"""Session-wide test setup shared by every test package."""

import os

# Nothing may be fetched from a model hub: every checkpoint is made locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Fixed thread count: results must not depend on the machine's core count.
torch.set_num_threads(2)
