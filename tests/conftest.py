import pytest
import torch


@pytest.fixture(autouse=True)
def _default_dtype_is_not_leaked():
    """A test that changes torch's default dtype must restore it (ManiSkill breaks under float64)."""
    yield
    assert torch.get_default_dtype() == torch.float32, "a test left torch's default dtype changed"
