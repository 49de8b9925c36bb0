"""Softmax's key/value cache through compile_step with inductor, the settings the throughput
task times: several steps in one graph must write each new key and value into the cache in
place, never through a copy of the whole cache."""
from functools import partial

import pytest
import torch

from repro.attention import SoftmaxAttention
from repro.models import AutoregressiveTransformer
from repro.models.generate import compile_step, generate

pytestmark = pytest.mark.slow  # inductor compiles


def _greedy(y):
    return y.argmax(-1)


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation made while fn() runs: the profiler's raw allocation
    records (an op's cpu_memory_usage nets out a buffer it allocates and frees)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"], default=0)


def test_compiled_steps_write_the_cache_in_place():
    """tokens_per_call=2 unrolls two steps in one graph. A copy_ into a narrow view of the cache
    made inductor copy each layer's whole keys and values (capacity slots) at every step, so the
    steps' cost grew with the cache's capacity (over 3x eager at CIFAR-10 size): nothing near the
    size of one layer's keys may be allocated in such a call, at an early and a late position,
    and the tokens must equal eager generation's."""
    capacity, length = 4096, 40
    torch.manual_seed(3)
    model = AutoregressiveTransformer(partial(SoftmaxAttention, initial_cache=capacity), 11, n_layers=2,
                                      d_model=16, n_heads=2, d_ff=16).eval()
    prefix = torch.randint(1, 11, (1, 3))
    ref = generate(model, prefix, length, _greedy)
    step = type(model).step.__get__(model)
    compile_step(model, backend="inductor", sample_fn=_greedy, tokens_per_call=2)
    assert torch.equal(generate(model, prefix, length, _greedy), ref)
    keys_bytes = capacity * model.encoder.layers[0].attention.n_heads * 8 * 4  # (1, H, capacity, D = 8) float32
    tokens = torch.zeros(1, dtype=torch.long)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        for position in (5, 900):
            state = None
            for _ in range(position):
                _, state = step(tokens, state)
            assert _largest_allocation(partial(model.sampling_step.several, tokens, state)) < keys_bytes // 8
