"""The experiments' command line (floor 2, above data/, training/ and tasks/, which never import
it): the checks before Hydra starts (preflight) and after it composed (validate), one run per
directory (rundir), the sweep callback, failed-job bookkeeping, the job's log file (joblog) and
publishing finished runs (publish)."""
