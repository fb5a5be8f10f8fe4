"""Shared test setup."""

import torch

# Tests run tiny models; one intra-op thread avoids oversubscription when other work shares the
# two cores (torch's spinning thread pool slowed small steps ~5x under load) and keeps runs exact.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def digits():
    """The bundled digits data set, loaded once for every test that trains on it."""
    from fedsga_edge.data import load_dataset

    return load_dataset("digits")
