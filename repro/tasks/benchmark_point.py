"""One point of the Figure 1 benchmark: forward + backward of one attention layer on random
input, timed and its peak memory measured.

On CPU each point runs in a fresh process (run_isolated: `python -m repro.tasks.benchmark_point
SPEC_JSON`, result as JSON on the last line of stdout), so its peak resident memory belongs
to that point alone. On CUDA it runs in-process with CUDA events and the caching allocator's
peak counter.
"""
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARENT_ENV = "REPRO_BENCHMARK_PARENT"  # the pid of the benchmark that started this point


def die_with_parent():
    """Ask the kernel (Linux) to SIGKILL this process when its parent dies, so a killed
    benchmark leaves no point running on under PID 1, holding its memory. If the parent is
    already gone (it died before this line), exit now."""
    if not sys.platform.startswith("linux") or PARENT_ENV not in os.environ:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ[PARENT_ENV]):
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()  # first, before the slow imports below

import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from repro.common import timing  # noqa: E402
from repro.common.config import parse_dtype  # noqa: E402
from repro.training.backends import layer_backend  # noqa: E402
from repro.training.memory import out_of_memory, saved_bytes  # noqa: E402


def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def prepare_rss_measure() -> str:
    """Make peak RSS track live memory from here on: glibc serves every block over 64 KiB with
    mmap (so a free returns it to the OS and a new tensor cannot hide in cached heap), the heap
    cache is trimmed, and the kernel's peak counter (VmHWM) is reset to the current RSS."""
    method = "peak RSS"
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
        method += ", glibc mmap threshold 64 KiB"
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return method + ", VmHWM reset"
    except OSError:
        return method + ", VmHWM since process start"


def measure(spec: dict) -> dict:
    """Spec: attention (config dict), d_model, n_heads, n, batch, causal, dtype, device,
    warmup, repeats, time_budget_s, seed. Returns the metrics, a status and the kernel the layer
    runs on (repro.training.backends; a timeout row names it too).

    Time: median over the timed passes after warm-up. Memory: the peak of more passes (up to
    `repeats`, as the budget allows; median, min and max), each beyond what was allocated
    before it (parameters, input and its gradient), i.e. the activations and workspaces of
    forward + backward. Kept for backward: the bytes autograd saves in one forward, counted over
    distinct storages (repro.training.memory; exact, parameters included)."""
    device, dtype = torch.device(spec["device"]), parse_dtype(spec["dtype"])
    cuda = device.type == "cuda"
    if not cuda:
        # Before the first pass: glibc raises its mmap threshold to the largest block freed so
        # far, so the warm-up passes' frees would put every later tensor in the heap, where freed
        # memory stays resident and the peak counts it again (linear at N = 4,096: 77.8 MB per
        # sample, against 57.8 MB held at most by torch's allocator).
        prepare_rss_measure()
    torch.manual_seed(spec["seed"])
    layer = instantiate(OmegaConf.create(spec["attention"]))(d_model=spec["d_model"], n_heads=spec["n_heads"])
    layer = layer.to(device=device, dtype=dtype)
    b, n = spec["batch"], spec["n"]
    backend = layer_backend(layer, b, n, dtype, device, spec["causal"])
    x = torch.randn(b, n, spec["d_model"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def one_pass():  # seconds: CUDA events on a GPU, else the wall clock
        elapsed = timing.time_calls(lambda: layer(x, causal=spec["causal"]).backward(grad), device, events=True).seconds
        x.grad = None
        layer.zero_grad(set_to_none=True)
        return elapsed

    budget = spec["time_budget_s"]
    began = time.perf_counter()
    for _ in range(spec["warmup"]):
        t_warm = one_pass()
        if time.perf_counter() - began > budget:
            return {"status": "timeout", "reason": f"a warm-up pass took {t_warm:.1f} s; budget {budget} s", **backend}
    times = [one_pass()]  # at least one timed pass, then as many more as the budget allows
    if time.perf_counter() - began > budget:
        return {"status": "timeout", "reason": f"one pass took {times[0]:.1f} s; budget {budget} s", **backend}
    # A measured point stays measured: repeats that would overrun the budget are dropped (the
    # row says how many were timed) instead of turning the point into a timeout.
    while len(times) < spec["repeats"] and time.perf_counter() - began + times[0] <= budget:
        times.append(one_pass())

    saved, y = saved_bytes(layer, x, causal=spec["causal"])
    y.backward(grad)
    x.grad, y = None, None
    layer.zero_grad(set_to_none=True)

    def peak_of_one_pass():
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            one_pass()
            return torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
        method = prepare_rss_measure()
        base = proc_status_kb("VmRSS") * 1024
        one_pass()
        return proc_status_kb("VmHWM") * 1024 - base, method

    peaks = []
    while not peaks or (len(peaks) < spec["repeats"] and time.perf_counter() - began + times[0] <= budget):
        peak, mem_method = peak_of_one_pass()
        peaks.append(peak)
    t, peak = statistics.median(times), statistics.median(peaks)
    return {"status": "ok", "time_ms": t * 1e3, "time_per_sample_ms": t * 1e3 / b,
            "peak_mem_mb": peak / 2**20, "mem_per_sample_mb": peak / 2**20 / b,
            "mem_per_sample_min_mb": min(peaks) / 2**20 / b, "mem_per_sample_max_mb": max(peaks) / 2**20 / b,
            "mem_repeats": len(peaks), "saved_mb": saved / 2**20, "saved_per_sample_mb": saved / 2**20 / b,
            "repeats": len(times), "mem_method": mem_method, **backend}


def measure_safely(spec: dict) -> dict:
    """measure(), with running out of memory turned into a row instead of a crash."""
    try:
        return measure(spec)
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as err:
        if (reason := out_of_memory(err)) is not None:
            return {"status": "oom", "reason": reason}
        raise
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_isolated(spec: dict, memory_limit: float, timeout: float) -> dict:
    """measure() in a fresh Python process, killed when it passes the memory limit (an 'oom'
    row, before the kernel's OOM killer hits the machine) or the time limit."""
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # The point dies with this process: killed here on any exception (Ctrl-C), and by the
        # kernel when this process is killed outright (die_with_parent).
        proc = subprocess.Popen([sys.executable, "-m", "repro.tasks.benchmark_point", json.dumps(spec)],
                                cwd=Path(__file__).resolve().parents[2], stdout=out, stderr=err, text=True,
                                env={**os.environ, PARENT_ENV: str(os.getpid())})
        try:
            ps, began, killed = psutil.Process(proc.pid), time.monotonic(), None
            while proc.poll() is None:
                try:
                    rss = ps.memory_info().rss
                except psutil.NoSuchProcess:
                    break
                if rss > memory_limit:
                    killed = {"status": "oom",
                              "reason": f"resident memory passed the limit of {memory_limit / 2**30:.1f} GiB"}
                elif time.monotonic() - began > timeout:
                    killed = {"status": "timeout", "reason": f"still running after {timeout:.0f} s"}
                if killed:
                    return killed
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().strip(), err.read().strip()
    if proc.returncode == 0 and stdout:
        return json.loads(stdout.splitlines()[-1])
    if proc.returncode in (-9, 137):
        return {"status": "oom", "reason": "killed by the operating system (out of memory)"}
    last = (stderr.splitlines() or ["no output"])[-1]
    return {"status": "error", "reason": f"exit {proc.returncode}: {last[:200]}"}


if __name__ == "__main__":
    result = measure_safely(json.loads(sys.argv[1]))
    print(json.dumps(result), flush=True)
