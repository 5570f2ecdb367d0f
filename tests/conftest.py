
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (tieredemb/gpu) run on CPU tensors under Triton's interpreter, which must be
    # chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Whether Triton kernels run interpreted in this process (they are compiled on a CUDA machine,
# where they cannot take CPU tensors).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run long soaks and crash runs")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="long run: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    compiled = pytest.mark.skip(reason="Triton kernels compile in this process (a CUDA machine) and cannot take CPU "
                                       "tensors: tests/test_gpu.py::test_the_cpu_tensor_tests_pass_in_a_child runs "
                                       "this file under the interpreter")
    for item in items:
        if "interpreted" in item.keywords and not INTERPRETED:
            item.add_marker(compiled)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def use_kernels(monkeypatch, which: str) -> None:
    """Makes tables run the native kernels (the CPU path's own) or the torch-ops twin."""
    import tieredemb.kernels

    if which == "torch":
        monkeypatch.setattr(tieredemb.kernels, "implementation", lambda pool: "torch")


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Runs a test with the native CPU kernels and with the torch-ops kernels (the GPU path)."""
    use_kernels(monkeypatch, request.param)
    return request.param
