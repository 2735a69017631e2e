import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# cost_model="auto" in tests: the shipped CPU preset, whatever this machine has calibrated (a model
# in the user's cache or TORCH_DCP_COST_MODEL would change the plans tests make); ranks inherit it
import tempfile  # noqa: E402

os.environ.pop("TORCH_DCP_COST_MODEL", None)
os.environ["TORCH_DCP_COST_CACHE"] = tempfile.mkdtemp(prefix="torch_dcp_cost_")

import pytest  # noqa: E402


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter on for one test (``TRITON_INTERPRET=1``: Triton reads it at each
    launch), so that the executor's Triton kernels run on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
