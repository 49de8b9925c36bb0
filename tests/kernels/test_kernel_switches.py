"""The CuPy kernels' switches (repro.kernels.plumbing.switches): set from REPRO_KERNEL_SWITCHES or
for a block by `switched`, read by the launch plan and the dispatcher's reasons (both observable
without a GPU), a bad name one line naming it and the valid ones."""
from pathlib import Path

import pytest
import torch

from repro.common.errors import ConfigError
from repro.kernels.causal_product import cuda as product_cuda
from repro.kernels.plumbing import cuda_grid, cupy_launch, switches
from repro.kernels.plumbing.switches import Switches, switched

REPO = Path(__file__).resolve().parents[2]  # tests/<folder>/this file
H100_OPTIN = 227 * 1024  # an H100's shared memory per block (opt-in)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv(switches.ENV, raising=False)
    monkeypatch.delenv("REPRO_KERNEL", raising=False)


def _bf16(d=64, m=64):
    return torch.zeros(2, 70, d, dtype=torch.bfloat16), torch.zeros(2, 70, d, dtype=torch.bfloat16), \
        torch.zeros(2, 70, m, dtype=torch.bfloat16)


def test_defaults_are_the_documented_ones():
    assert switches.current() == Switches() == Switches(gpu_verified=True, tensor_cores=True, bare_smem=False,
                                                        vec_loads=False, staged=False, prefill_nan=False)
    docs = (REPO / "docs" / "kernels.md").read_text()
    for name in switches.NAMES:  # each switch described where the kernels are
        assert f"`{name}`" in docs, name


@pytest.mark.parametrize("text", ["staged,turbo", "STAGED, no_warp", "bare-smem"])
def test_a_bad_switch_is_one_line_naming_it_and_the_valid_ones(monkeypatch, text):
    monkeypatch.setenv(switches.ENV, text)
    with pytest.raises(ConfigError) as err:
        switches.current()
    msg = str(err.value)
    bad = [t.strip().lower() for t in text.split(",") if t.strip().lower().removeprefix("no_") not in switches.NAMES]
    assert "\n" not in msg and repr(bad[0]) in msg and "REPRO_KERNEL_SWITCHES" in msg
    assert all(name in msg for name in switches.NAMES)
    with pytest.raises(ConfigError, match="'turbo' is not a kernel switch"), switched(turbo=True):
        pass


def test_the_environment_and_switched_set_what_a_launch_plans(monkeypatch):
    """The kernel a bf16 launch takes at D = M = 64: the tensor-core kernel with the normaliser's
    bytes by default; bare_smem asks only what the bare product uses; staged takes the pipelined
    kernel (not with the normaliser); vec_loads 16-byte loads; tensor_cores off the FMA kernel."""
    q, k, v = _bf16()
    plan = lambda norm=False: product_cuda.plan(q, k, v, norm, H100_OPTIN)
    assert plan() == ("tensor_cores", cuda_grid.smem_chunks_tc(64, True), False)
    with switched(bare_smem=True):
        assert plan() == ("tensor_cores", cuda_grid.smem_chunks_tc(64, False), False)
        with switched("vec_loads"):  # nested: on top of the block's switches
            assert plan() == ("tensor_cores", cuda_grid.smem_chunks_tc(64, False), True)
        assert plan()[2] is False
    assert plan() == ("tensor_cores", cuda_grid.smem_chunks_tc(64, True), False)  # restored
    monkeypatch.setenv(switches.ENV, "Staged")
    assert plan() == ("staged", cuda_grid.SMEM_STAGED, False)
    assert plan(norm=True)[0] == "tensor_cores"
    assert product_cuda.plan(*_bf16(d=70), False, H100_OPTIN)[0] == "tensor_cores"  # D > 64: not staged
    with switched(staged=False):
        assert plan()[0] == "tensor_cores"
    monkeypatch.setenv(switches.ENV, "no_tensor_cores")
    assert plan() == ("fma", cuda_grid.smem_chunks(64), False)
    assert product_cuda.plan(q.float(), k.float(), v.float(), False, H100_OPTIN, tensor_cores=True)[0] == "fma"


def test_gpu_verified_and_prefill_reach_the_dispatcher_and_the_outputs(monkeypatch):
    q = torch.zeros(1, 2, 5, 3, dtype=torch.bfloat16)
    assert "CUDA tensors only" in product_cuda.unsupported_reason(q, q, q)  # verified: only the device declines
    monkeypatch.setenv(switches.ENV, "no_gpu_verified")
    assert "not yet verified on a GPU" in product_cuda.unsupported_reason(q, q, q)
    monkeypatch.delenv(switches.ENV)
    with switched(prefill_nan=True):
        assert cupy_launch.empty((4,), torch.float32, "cpu").isnan().all()
