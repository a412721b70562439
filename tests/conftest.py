"""Session-wide test setup shared by every test package."""

import torch

# Fixed thread count: results must not depend on the machine's core count.
torch.set_num_threads(2)
