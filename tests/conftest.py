
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
    parser.addoption("--program-order", choices=["grid", "reversed", "shuffled"], default="grid",
                     help="the order in which Triton's interpreter runs a launch's programs: a GPU runs them "
                          "in any order, at once, so a kernel's result must not depend on it")


def interpreter_scalars() -> bool:
    """Triton's interpreter before 3.7 (3.6.0 is what torch 2.11 pins: the GPU machine's, where
    test_gpu.py's child runs the interpreted tests) turns a kernel's scalar into a Python int with
    int() of its 1-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
    converted"): every kernel whose loop bounds it loads fails there. Makes it squeeze the
    array first, as later Triton does. Returns whether it was needed (numpy refuses)."""
    import numpy as np

    try:
        int(np.ones(1, dtype=np.int64))
        return False
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope, *rest):
        patch(tensor, scope, *rest)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    return True


def pytest_configure(config):
    if INTERPRETED:
        interpreter_scalars()
    order = config.getoption("--program-order")
    if order != "grid":
        if not INTERPRETED:
            raise pytest.UsageError("--program-order applies to Triton's interpreter (TRITON_INTERPRET=1)")
        program_order(order)


def program_order(order: str, seed: int = 0):
    """Makes Triton's interpreter run each launch's programs in another order than the grid's: it
    runs them one after another, in order, so a kernel that reads what an earlier program wrote
    passes under it and fails on a GPU. Reversed or shuffled, such a kernel's tests fail here too.
    (Programs still run whole, one at a time: lost updates between programs that interleave on a
    GPU are not shown.) Returns what undoes it."""
    import numpy as np
    from triton.runtime import interpreter

    builder, rng = interpreter.interpreter_builder, np.random.default_rng(seed)
    grid_dim = type(builder).set_grid_dim
    perm = {}

    def set_grid_dim(nx, ny, nz):
        grid_dim(builder, nx, ny, nz)
        n = nx * ny * nz
        perm["p"] = np.arange(n)[::-1] if order == "reversed" else rng.permutation(n)

    def set_grid_idx(x, y, z):
        nx, ny, nz = builder.grid_dim
        k = int(perm["p"][(x * ny + y) * nz + z])
        builder.grid_idx = (k // (ny * nz), k // nz % ny, k % nz)

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    return lambda: (vars(builder).pop("set_grid_dim"), vars(builder).pop("set_grid_idx"))


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
