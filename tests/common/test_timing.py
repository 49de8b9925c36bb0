"""repro.common.timing against independent references: calls that sleep or burn CPU for a known
time (the wall clock and the process's CPU clock must read them back), recording stubs for which
calls run in which order and which of them are timed, and the passes of the causal product's
methods. Sleeps overshoot on a loaded machine, never undershoot: the bounds are one-sided wide."""
import statistics
import time

import pytest
import torch

from repro.common import timing

SLACK = 0.04  # seconds a sleep may overrun on a shared machine


def sleeper(durations, log=None, name=None):
    """A call that sleeps durations[i] on its i-th call (and records its name)."""
    calls = iter(durations)

    def fn():
        if log is not None:
            log.append(name)
        time.sleep(next(calls))
    return fn


def burn_cpu(seconds):
    """Spin until this process has used `seconds` of CPU time, however long that takes on the wall."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_a_sleeping_call_takes_wall_time_and_no_cpu_time():
    span = timing.time_calls(lambda: time.sleep(0.08))
    assert 0.08 <= span.seconds < 0.08 + SLACK
    assert span.cpu_seconds < 0.02


def test_a_spinning_call_takes_its_cpu_time():
    span = timing.time_calls(lambda: burn_cpu(0.05))
    assert 0.05 <= span.cpu_seconds < 0.05 + 0.01
    assert span.seconds >= span.cpu_seconds - 1e-3  # one thread cannot use CPU faster than the wall clock


def test_a_block_of_calls_is_timed_per_call():
    log = []
    span = timing.time_calls(sleeper([0.02, 0.04, 0.06, 0.08], log, "a"), calls=4)
    assert log == ["a"] * 4
    assert 0.05 <= span.seconds < 0.05 + SLACK / 4 + 0.01  # (0.02 + 0.04 + 0.06 + 0.08) / 4


def test_repeat_times_each_block_and_keeps_warm_up_calls_out():
    # the warm-up calls sleep long: a timer that counted them would see it in every statistic
    fn = sleeper([0.3, 0.3] + [0.01, 0.07, 0.03])
    t = timing.repeat(fn, repeats=3, warmup=2)
    assert len(t.times) == 3
    for got, slept in zip(t.times, [0.01, 0.07, 0.03]):
        assert slept <= got < slept + SLACK
    assert t.median == statistics.median(t.times) and 0.03 <= t.median < 0.03 + SLACK
    assert t.mean == pytest.approx(sum(t.times) / 3)
    with pytest.raises(StopIteration):  # exactly warmup + repeats calls were made
        fn()


def test_interleaved_runs_warm_up_then_rounds_in_order_and_times_only_the_round_calls():
    """warmup: every call of the first fn's, then the next fn's; each round: every fn in the
    dict's order, each timed call right after its `settle` untimed calls."""
    log = []
    # per fn: 2 warm-up calls, then per round 1 settle call and 1 timed call; only the timed ones are short
    long, a_timed, b_timed = 0.15, [0.0, 0.03], [0.02, 0.0]
    fns = {"a": sleeper([long, long, long, a_timed[0], long, a_timed[1]], log, "a"),
           "b": sleeper([long, long, long, b_timed[0], long, b_timed[1]], log, "b")}
    t = timing.interleaved(fns, rounds=2, warmup=2, settle=1)
    assert "".join(log) == "aabb" + "aabb" * 2
    for name, slept in (("a", a_timed), ("b", b_timed)):
        assert len(t[name].times) == 2
        for got, expected in zip(t[name].times, slept):
            assert expected <= got < expected + SLACK
        assert t[name].median == statistics.median(t[name].times)


def test_interleaved_without_settle_alternates_a_b_c():
    log = []
    fns = {x: (lambda x=x: log.append(x)) for x in "abc"}
    timing.interleaved(fns, rounds=3, warmup=1)
    assert "".join(log) == "abc" + "abc" * 3


def test_stopwatch_reads_wall_and_cpu_time_since_it_started():
    watch = timing.Stopwatch()
    time.sleep(0.05)
    first = watch.wall()
    burn_cpu(0.03)
    assert 0.05 <= first < 0.05 + SLACK and watch.wall() >= first + 0.03 - 1e-3
    assert 0.03 <= watch.cpu() < 0.03 + 0.02


def test_time_product_builds_each_methods_pass_on_its_own_inputs():
    """fwd: the op without autograd; fwd_bwd: the op and the gradients of the inputs that require
    them; inputs(name, backward) asked once per method and pass; the timer gets one pass's calls
    in the methods' order."""
    seen, asked = [], []

    def op(tag):
        def run(q, k, v):
            seen.append((tag, torch.is_grad_enabled()))
            return (q * k).sum(-1, keepdim=True) * v
        return run

    def inputs(name, backward):
        asked.append((name, backward))
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=backward) for _ in range(3)]
        return xs, torch.ones(1, 2, 5, 3, dtype=torch.float64)

    def timer(calls):
        assert list(calls) == ["b", "a"]
        return {name: (call(), name.upper())[1] for name, call in calls.items()}

    out = timing.time_product({"b": op("b"), "a": op("a")}, inputs, ["fwd", "fwd_bwd"], timer)
    assert out == {"fwd": {"b": "B", "a": "A"}, "fwd_bwd": {"b": "B", "a": "A"}}
    assert asked == [("b", False), ("a", False), ("b", True), ("a", True)]
    assert seen == [("b", False), ("a", False), ("b", True), ("a", True)]


def test_one_call_runs_the_backward_against_the_given_gradient_for_the_inputs_that_need_it():
    """fwd_bwd: the upstream gradient reaching the op's output is `grad` itself, and the gradients
    asked for are those of the inputs that require them (an input without one is left out, not
    an error); nothing accumulates in .grad."""
    q, k, v = (torch.randn(2, 4, dtype=torch.float64, requires_grad=r) for r in (True, False, True))
    grad = torch.randn(2, 4, dtype=torch.float64)
    upstream, wanted = [], []

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q * k + v

        @staticmethod
        def backward(ctx, g):
            upstream.append(g)
            wanted.append(ctx.needs_input_grad)
            return g, g, g

    timing.one_call(Op.apply, (q, k, v), grad, backward=True)()
    assert len(upstream) == 1 and torch.equal(upstream[0], grad) and wanted == [(True, False, True)]
    assert q.grad is None and v.grad is None
    timing.one_call(Op.apply, (q, k, v), grad, backward=False)()
    assert len(upstream) == 1  # the forward alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_and_the_synchronised_wall_clock_both_see_queued_work():
    """A kernel that spins on the device: the wall clock (the device synchronised around the
    call) and the events read the same time, which a wall clock without the synchronisation,
    returning as soon as the kernel is queued, would not."""
    device = torch.device("cuda")
    torch.cuda._sleep(1000)  # the first launch's set-up outside the timings
    torch.cuda.synchronize()
    spin = 50_000_000  # cycles: tens of ms on any current GPU
    wall = timing.time_calls(lambda: torch.cuda._sleep(spin), device).seconds
    events = timing.repeat(lambda: torch.cuda._sleep(spin), 3, device, warmup=1, events=True).median
    queued = time.perf_counter()
    torch.cuda._sleep(spin)
    queued = time.perf_counter() - queued
    torch.cuda.synchronize()
    assert wall > 0.005 and queued < 0.2 * wall
    assert events == pytest.approx(wall, rel=0.25)
