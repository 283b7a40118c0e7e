import pytest
import torch

from latentlm.models import backend as dispatch


@pytest.fixture(autouse=True)
def _no_engine_choices():
    """Every model test starts without measured engine choices (`backend.CHOICES`, which `calibrate` fills for
    the whole process, as the service's registry does at load), and leaves none behind: the engine a test
    sees must not depend on which tests ran before it in the same process."""
    saved = dict(dispatch.CHOICES)
    dispatch.CHOICES.clear()
    yield
    dispatch.CHOICES.clear()
    dispatch.CHOICES.update(saved)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a 2-core machine (use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
