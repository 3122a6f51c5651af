import pytest
import torch

# One torch thread: tests share 2 cores with ManiSkill workers and nbval kernels, and two threads
# under contention made small steps 25x slower on the CI machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _default_dtype_is_not_leaked():
    """A test that changes torch's default dtype must restore it (ManiSkill breaks under float64)."""
    yield
    assert torch.get_default_dtype() == torch.float32, "a test left torch's default dtype changed"
