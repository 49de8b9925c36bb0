"""torch.distributed for the training loop: one process per device, started by torchrun (or by
SLURM through hydra-submitit-launcher with tasks_per_node > 1), gradients averaged by
DistributedDataParallel.

    torchrun --nproc_per_node=2 run.py task=copy ...          # gloo on CPU, nccl on GPUs

What each rank sees: the GLOBAL batch of the task (trainer batch sizes mean the same with 1 or
8 processes), of which rank r takes rows [r * B/W, (r + 1) * B/W) (`RankShard`). A task whose
train_data already shards itself (ShuffledBatches(rank=, world_size=)) is left alone. Rank 0
alone logs, writes rows and checkpoints; all ranks share one Hydra run dir (`share_run_dir`:
rank 0 resolves Hydra's run/sweep dir, ${now:} and ${uid:} included, and broadcasts it).
"""
import datetime
import io
import os
import sys

import torch
import torch.distributed as dist

from repro.common.errors import ConfigError


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _from_slurm():
    """A SLURM job step with several tasks (submitit, srun) sets SLURM_* but not torchrun's
    variables: submitit translates them (MASTER_ADDR from the node list, a port from the job id)."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "SUBMITIT_FOLDER" not in os.environ \
            and "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def init(timeout_s: float = 1800) -> bool:
    """Join the process group described by the environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK, or SLURM's under submitit). Idempotent; False when
    this is a single process. CPU: gloo. GPU: nccl for tensors, gloo beside it for objects."""
    if dist.is_available() and dist.is_initialized():
        return True
    _from_slurm()
    if env_world_size() <= 1:
        return False
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={env_world_size()} but {', '.join(missing)} unset: start with torchrun "
                          f"(torchrun --nproc_per_node=N run.py ...) or under SLURM through submitit")
    backend = "gloo"
    if torch.cuda.is_available() and os.environ.get("REPRO_DIST_BACKEND", "") != "gloo":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier():
    if is_distributed():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's obj on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's obj, in rank order. Serialised by torch.save first: objects holding tensors
    (RNG states) do not survive all_gather_object's own pickling in this torch."""
    if not is_distributed():
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    out = [None] * world_size()
    dist.all_gather_object(out, buf.getvalue())
    # Full unpickling is safe here: the bytes are this job's own ranks' objects, exchanged in memory
    # over the process group, never a file from outside the process.
    return [torch.load(io.BytesIO(b), weights_only=False) for b in out]


def mean_across_ranks(values: list[float]) -> list[float]:
    """Element-wise mean over ranks, in float64 (a CPU tensor under gloo, the device's under nccl)."""
    if not is_distributed() or not values:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() != "gloo" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world_size()).tolist()


def cleanup():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ batches

def shard(batch, rank_: int, world: int):
    """Rows [rank * B/W, (rank + 1) * B/W) of every tensor in the batch (dicts, lists nest)."""
    if isinstance(batch, torch.Tensor):
        b = batch.shape[0]
        if b % world:
            raise ConfigError(f"a global batch of {b} cannot be split evenly over {world} processes: "
                              f"make the batch size a multiple of {world}")
        n = b // world
        return batch[rank_ * n:(rank_ + 1) * n]
    if isinstance(batch, dict):
        return {k: shard(v, rank_, world) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard(v, rank_, world) for v in batch)
    return batch


class RankShard:
    """This rank's slice of every global batch of `stream`. Every rank draws the same global
    batches (same seed), so the data stream's state is the same on all ranks and rank 0's
    checkpoint of it resumes them all."""

    def __init__(self, stream, rank_: int, world: int):
        self.stream, self.rank, self.world_size = stream, rank_, world

    def __iter__(self):
        return self

    def __next__(self):
        return shard(next(self.stream), self.rank, self.world_size)

    def state_dict(self):
        return self.stream.state_dict()

    def load_state_dict(self, state):
        self.stream.load_state_dict(state)

    def __getattr__(self, name):  # the stream's own attributes (batches drawn, vocab size...)
        return getattr(self.__dict__["stream"], name)


# ------------------------------------------------------------------------------ run dir

def _dir_override(argv) -> str | None:
    """The run dir override Hydra would compute for this command line, resolved on rank 0."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    from repro.conf import CONF_DIR

    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if any(a.startswith(key + "=") for a in argv):
        return None  # the user named it: the same on every rank already
    overrides = [a for a in argv if not a.startswith("-")]
    setup_globals()  # Hydra's ${now:} resolver
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        value = OmegaConf.select(cfg, key)
    GlobalHydra.instance().clear()
    return f"{key}='{value}'" if "'" not in str(value) else f"{key}={value}"


def share_run_dir(argv=None) -> list:
    """Under torchrun: join the process group, let rank 0 resolve the run dir (its ${now:}
    and ${uid:}) and append it to every rank's command line, so that all ranks write one run
    dir. Returns argv (changed in place). A no-op for a single process."""
    argv = sys.argv if argv is None else argv
    if env_world_size() <= 1 or any(a in ("--help", "-h", "--cfg", "-c", "--info") for a in argv):
        return argv
    init()
    override = None
    if is_main():
        try:
            override = _dir_override(argv[1:])
        except Exception as err:  # a bad override: Hydra itself reports it on every rank below
            print(f"warning: could not resolve the run dir on rank 0 ({err}); ranks may use separate dirs",
                  file=sys.stderr)
    override = broadcast_object(override)
    if override:
        argv.append(override)
    return argv
