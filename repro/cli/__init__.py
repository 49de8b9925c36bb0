"""The experiments' command line (floor 2, with data/, training/ and tasks/): Hydra helpers
(config), the checks before Hydra starts (preflight) and after it composed (validate), the
sweep callback, failed-job bookkeeping and the run's logging (run dir, CSV, wandb)."""
