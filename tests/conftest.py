import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

# pytest -n: the workers share the cores. torch's default (a thread per core) in each worker left the
# workers' threads waiting on one another: the kernel and memory tests took 61-71 s on 2 workers and 2
# cores, 41 s with a thread per worker. Tests of threading set their own count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> the full config, as `python run.py overrides...` would see it."""
    # Imported here, not at the top: the kernel tests must run on a GPU machine that has only
    # torch, CuPy, numpy and pytest (no Hydra), and every test file loads this conftest.
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR

    def _compose(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    return _compose


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
