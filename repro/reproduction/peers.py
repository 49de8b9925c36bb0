"""The benchmark's peers from outside this suite, each loaded only if it can run here; otherwise
the reason, which the benchmark writes as a `missing` row.

    fast_transformers   the authors' CUDA kernel (pytorch-fast-transformers 0.4.0, fp32 only).
                        Its sdist does not build with a current nvcc (setup.py passes
                        -arch=compute_50), so only fast_transformers/causal_product/
                        causal_product_cuda.cu is taken from the sdist file that
                            pip download pytorch-fast-transformers==0.4.0 --no-deps --no-binary :all:
                        gives (`make gpu-bundle` puts it in gpu_bundle/) and built with
                        torch.utils.cpp_extension.load for the GPU in use. The file sets
                        ENABLE_NVIDIA_OPTIMIZATIONS itself (its `#define` at the top), so the
                        build takes NVIDIA's contributed fast path where the shape allows, as the
                        release's build does. A benchmark peer only: never a dependency, never
                        committed.
    fla_chunk           flash-linear-attention's chunk_linear_attn (Triton), in its native
                        (B, N, H, D) layout, unnormalised, scale 1.
    fla_retention, fla_gla, fla_delta   its chunk kernels for the successors (chunk_retention,
                        whose decays are RetNet's 1 - 2^(-5 - h) built in; chunk_gla; chunk_delta_rule),
                        the same layout, scale 1, peers of gated_causal_dot_product and
                        delta_rule_dot_product.

Every peer is fn(q, k, v) -> out on tensors in its `layout` ("bhnd" or "bnhd"), or, for the
successors' ops, fn(q, k, v, x) with x its `extra` input: "per_step" (log decays, (.., N)),
"per_dim" (log decays per key dimension) or "beta". Whether a peer
can run is decided by the device the benchmark was asked to use, never by whether some CUDA
device is visible: a CPU run on a GPU machine still reports the CUDA-only peers as missing.
"""
import importlib.metadata
import inspect
import os
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.common.results import REPO

FT_SDIST_NAMES = ("pytorch-fast-transformers-0.4.0.tar.gz", "pytorch_fast_transformers-0.4.0.tar.gz")
FT_MEMBER = "fast_transformers/causal_product/causal_product_cuda.cu"
BUNDLE = REPO / "gpu_bundle"
BUILD = REPO / "build" / "fast_transformers"


@dataclass
class Peer:
    fn: Callable | None
    why: str | None = None  # None when fn runs; else "missing: <reason>"
    layout: str = "bhnd"
    dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)
    extra: str | None = None  # the successors' ops: which fourth input fn takes (module docstring)


def find_ft_sdist(path=None):
    """The fast-transformers sdist: `path`, $REPRO_FT_SDIST, or the GPU bundle's copy."""
    for cand in (path, os.environ.get("REPRO_FT_SDIST"), *(BUNDLE / n for n in FT_SDIST_NAMES)):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def extract_ft_source(sdist, dest=BUILD, member=FT_MEMBER):
    """One source file (by default causal_product_cuda.cu) out of the sdist into dest; its path."""
    with tarfile.open(sdist) as tar:
        found = next((m for m in tar.getmembers() if m.name.endswith(member)), None)
        if found is None:
            raise FileNotFoundError(f"{sdist} holds no {member}")
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / Path(member).name
        out.write_bytes(tar.extractfile(found).read())
    return out


def ft_autograd(ext):
    """fn(q, k, v) -> out: fast_transformers.causal_product.CausalDotProduct over an extension
    built here (its CUDA or its CPU kernel): the kernels write into zero-filled outputs the
    caller allocates."""
    class FTCausalDotProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            out = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)
            ext.causal_dot_product(q, k, v, out)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v = ctx.saved_tensors
            gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            ext.causal_dot_backward(q, k, v, g.contiguous(), gq, gk, gv)
            return gq, gk, gv

    return FTCausalDotProduct.apply


def _ninja_on_path():
    """cpp_extension runs `ninja`; the ninja wheel installed with --target (the GPU bundle) puts
    its binary in <target>/bin, which is not on PATH (and ninja.BIN_DIR does not point there)."""
    import shutil
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    for folder in (Path(ninja.__file__).resolve().parents[1] / "bin",
                   Path(getattr(ninja, "BIN_DIR", "") or "/nonexistent")):
        if (folder / "ninja").is_file():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _not_cuda(device, what) -> str | None:
    """Why a CUDA-only peer cannot run on `device` (None when it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"missing: {what} runs on CUDA only and this run is on {device.type}"
    if not torch.cuda.is_available():
        return f"missing: {what} runs on CUDA only and no CUDA device is visible"
    return None


def fast_transformers(device, sdist=None, verbose=False) -> Peer:
    why = _not_cuda(device, "the authors' kernel")
    if why:
        return Peer(None, why)
    found = find_ft_sdist(sdist)
    if found is None:
        return Peer(None, "missing: no pytorch-fast-transformers-0.4.0 sdist (run `make gpu-bundle`, "
                          "or set REPRO_FT_SDIST to the file `pip download pytorch-fast-transformers==0.4.0 "
                          "--no-deps --no-binary :all:` gives)")
    from torch.utils import cpp_extension
    _ninja_on_path()
    if cpp_extension.CUDA_HOME is None:
        return Peer(None, "missing: no CUDA toolkit (nvcc) to build the authors' kernel with")
    if not cpp_extension.is_ninja_available():
        return Peer(None, "missing: torch.utils.cpp_extension needs ninja (pip install ninja; it is in the GPU bundle)")
    major, minor = torch.cuda.get_device_capability(device)
    try:
        src = extract_ft_source(found)
        # For the GPU in use only: cpp_extension reads TORCH_CUDA_ARCH_LIST.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        build = BUILD / f"sm{major}{minor}"
        build.mkdir(parents=True, exist_ok=True)
        ext = cpp_extension.load(
            name=f"ft_causal_product_cuda_sm{major}{minor}", sources=[str(src)], build_directory=str(build),
            extra_cuda_cflags=["-O3"], verbose=verbose)
    except Exception as err:  # a compiler error: the row says so, the benchmark goes on
        first = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        return Peer(None, f"missing: building causal_product_cuda.cu failed ({first[:200]})")
    return Peer(ft_autograd(ext), dtypes=(torch.float32,))


def fla_chunk(device) -> Peer:
    why = _not_cuda(device, "fla's Triton kernels")
    if why:
        return Peer(None, why, layout="bnhd")
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as err:  # ImportError, or a Triton that does not match
        return Peer(None, f"missing: flash-linear-attention not importable ({str(err).splitlines()[0][:200]})",
                    layout="bnhd")
    extra = {"head_first": False} if "head_first" in inspect.signature(chunk_linear_attn).parameters else {}

    def fla(q, k, v):  # (B, N, H, D), (B, N, H, D), (B, N, H, M) -> (B, N, H, M): no copies
        return chunk_linear_attn(q, k, v, scale=1.0, normalize=False, **extra)[0]
    return Peer(fla, layout="bnhd")


FLA_SUCCESSORS = {"fla_retention": ("fla.ops.retention", "chunk_retention", "per_step"),
                  "fla_gla": ("fla.ops.gla", "chunk_gla", "per_dim"),
                  "fla_delta": ("fla.ops.delta_rule", "chunk_delta_rule", "beta")}


def fla_successor(name, device) -> Peer:
    """fla's chunk kernel for one successor (FLA_SUCCESSORS), in (B, N, H, D) layout, scale 1."""
    module, fn_name, extra = FLA_SUCCESSORS[name]
    why = _not_cuda(device, "fla's Triton kernels")
    if why:
        return Peer(None, why, layout="bnhd", extra=extra)
    try:
        import importlib
        fn = getattr(importlib.import_module(module), fn_name)
    except Exception as err:  # ImportError, or a Triton that does not match
        return Peer(None, f"missing: flash-linear-attention not importable ({str(err).splitlines()[0][:200]})",
                    layout="bnhd", extra=extra)
    if extra == "per_step":  # the decays are built in (RetNet's), as the benchmark's inputs give them
        return Peer(lambda q, k, v, x: fn(q, k, v, scale=1.0)[0], layout="bnhd", extra=extra)
    # fla 0.6's chunk_delta_rule refuses fp32 ("Please use bfloat16")
    dtypes = (torch.bfloat16, torch.float16) if extra == "beta" else (torch.float32, torch.bfloat16, torch.float16)
    return Peer(lambda q, k, v, x: fn(q, k, v, x, scale=1.0)[0], layout="bnhd", extra=extra, dtypes=dtypes)


PEER_DIST = "pytorch-fast-transformers"


def build_ft_cpu(sdist: Path):
    """Compile only the CPU causal product of the authors' sdist (torch's JIT extension builder,
    cached under ~/.cache/torch_extensions; about a minute the first time on this machine)."""
    from torch.utils.cpp_extension import load

    member = "fast_transformers/causal_product/causal_product_cpu.cpp"
    try:
        src = extract_ft_source(sdist, Path(tempfile.mkdtemp(prefix="ft_sdist_")), member)
    except FileNotFoundError:
        raise SystemExit(f"--peer-sdist {sdist}: no {member} inside; expected the PyPI sdist of {PEER_DIST} 0.4.0") \
            from None
    return ft_autograd(load("fast_transformers_causal_product_cpu", [str(src)],
                            extra_cflags=["-O3", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"]))


def ft_cpu_peer(sdist: str | None):
    """The CPU-speed benchmark's peer (repro.reproduction.cpu_speed): (fn or None, version or why
    missing), from the installed package or the sdist's CPU causal product built here."""
    try:
        from fast_transformers.causal_product import causal_dot_product
        return causal_dot_product, _version(PEER_DIST) or "importable (version unknown)"
    except Exception as err:  # ImportError, or an installed build without its CPU extension
        reason = f"missing: fast_transformers not importable ({type(err).__name__}: {err})"
    if sdist is None:
        return None, reason + "; pass --peer-sdist (README: 'CPU speed of the core')"
    if not Path(sdist).is_file():
        raise SystemExit(f"--peer-sdist {sdist}: no such file; expected the PyPI sdist of {PEER_DIST} 0.4.0 "
                         f"(pip download {PEER_DIST}==0.4.0 --no-deps --no-binary :all: --no-build-isolation)")
    try:
        return build_ft_cpu(Path(sdist)), f"0.4.0 sdist built here ({Path(sdist).name})"
    except Exception as err:  # no compiler, no ninja: the peer is optional, so its row says why
        return None, (f"missing: building {Path(sdist).name} failed "
                      f"({type(err).__name__}: {str(err).splitlines()[0][:200]})")


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
