"""How many CPU threads torch uses: trainer.threads (training) and task.threads (throughput).

    auto  (the default) OMP_NUM_THREADS when it is set; else, on CPU, 1 thread
    N     N threads
    null  torch's own default (one per physical core)

Why 1 on CPU: the models a CPU trains or samples here are small (d_model 64-256, batch 1-64),
whose matrix products gain little from a second thread, and CPUs are usually shared: with other
jobs on the cores (a sweep's parallel jobs included), torch's OpenMP threads wait for each
other and a run with one thread per core is several times slower than with 1 (docs/training.md,
"Threads"). A GPU run keeps torch's default (its CPU threads only feed the GPU).
"""
import os

import torch

from repro.common.errors import ConfigError


def set_threads(setting, device: torch.device, key: str = "trainer.threads") -> int:
    """Apply the setting (see the module's docstring); returns the threads torch now uses."""
    if setting == "auto":
        if os.environ.get("OMP_NUM_THREADS"):
            setting = int(os.environ["OMP_NUM_THREADS"]) if os.environ["OMP_NUM_THREADS"].isdigit() else None
        else:
            setting = 1 if device.type == "cpu" else None
    elif setting is not None and (isinstance(setting, bool) or not isinstance(setting, int) or setting < 1):
        raise ConfigError(f"{key}={setting!r}; valid: auto, a positive integer, or null (torch's default)")
    if setting is not None and setting != torch.get_num_threads():
        torch.set_num_threads(setting)
    return torch.get_num_threads()
