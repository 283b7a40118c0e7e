import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a 2-core machine (use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
