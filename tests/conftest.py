"""Shared test setup."""

import torch

# Tests run tiny models; one intra-op thread avoids oversubscription when other work shares the
# two cores (torch's spinning thread pool slowed small steps ~5x under load) and keeps runs exact.
torch.set_num_threads(1)
