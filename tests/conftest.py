import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")


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
