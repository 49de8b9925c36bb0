"""The ground floor: what every other floor uses and nothing here imports Hydra, OmegaConf or
wandb. results: atomic writes, JSONL/CSV rows, provenance of a row (device, versions, git SHA),
the repository's results folder; errors: the user's errors; paper: the paper's numbers."""
