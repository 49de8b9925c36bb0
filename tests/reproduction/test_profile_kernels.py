"""repro.reproduction.profile_kernels on a CPU: the kernel table from profiler events, the inputs,
and a one-line refusal without a GPU (the profile itself needs a CUDA GPU)."""
from types import SimpleNamespace

import torch

from repro.common import timing
from repro.reproduction import profile_kernels


def _event(key, device_type, total, count):
    return SimpleNamespace(key=key, device_type=device_type, device_time_total=total, count=count)


def test_kernel_shares_keeps_device_kernels_per_call_largest_first():
    events = [_event("aten::empty", torch.autograd.DeviceType.CPU, 0, 40),
              _event("cdp_chunks_tc<__nv_bfloat16,false,false>", torch.autograd.DeviceType.CUDA, 300.0, 10),
              _event("cdp_scan_states", torch.autograd.DeviceType.CUDA, 20.0, 10),
              _event("cdp_group_states_tc<...>", torch.autograd.DeviceType.CUDA, 80.0, 10)]
    # a record_function range (the optimizer's step) shown on the device: it spans kernels, it is none
    events.append(SimpleNamespace(**{**vars(_event("Optimizer.step#RAdam.step", torch.autograd.DeviceType.CUDA,
                                                   900.0, 10)), "is_user_annotation": True}))
    rows = profile_kernels.kernel_shares(events, calls=10)
    assert [r["kernel"][:8] for r in rows] == ["cdp_chun", "cdp_grou", "cdp_scan"]
    assert rows[0]["us_per_call"] == 30.0 and rows[0]["launches_per_call"] == 1.0
    assert abs(rows[0]["share"] - 0.75) < 1e-12 and abs(sum(r["share"] for r in rows) - 1) < 1e-12


def test_kernel_shares_reads_the_older_cuda_time_name():
    old = SimpleNamespace(key="k", device_type=torch.autograd.DeviceType.CUDA, cuda_time_total=5.0, count=2)
    assert profile_kernels.kernel_shares([old], calls=2)[0]["us_per_call"] == 2.5


def test_inputs_are_phi_features_with_the_asked_shapes():
    (q, k, v), up = profile_kernels.inputs(2, 3, 17, 5, 7, torch.bfloat16, torch.device("cpu"), grad=True)
    assert q.shape == k.shape == (2, 3, 17, 5) and v.shape == up.shape == (2, 3, 17, 7)
    assert q.dtype == torch.bfloat16 and q.requires_grad and not up.requires_grad
    assert bool((q > 0).all()) and bool((k > 0).all())  # elu + 1 > 0


def test_refuses_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile_kernels.main(["--lengths", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


def test_switches_turn_variants_on_for_every_part_and_keep_their_files_apart(tmp_path, monkeypatch):
    """--switch STAGED: the parts (and ncu's child process) run with the variant on, their rows say
    so, and their files go to a folder of their own beside the plain runs'."""
    from repro.kernels.plumbing import switches

    monkeypatch.delenv(switches.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(profile_kernels, "provenance", lambda device: {"device": "Fake GPU"})
    seen = {}
    monkeypatch.setattr(profile_kernels, "kernels_part",
                        lambda args, base, out_dir, backend, device: seen.update(
                            staged=switches.current().staged, base=base, out_dir=out_dir))
    monkeypatch.setattr(profile_kernels, "run_ncu", lambda out_dir, n, timeout_s, switches=(): seen.update(
        ncu=(out_dir, list(switches))) or "ncu ok")
    assert profile_kernels.main(["--parts", "kernels", "--switch", "STAGED", "--ncu", "--out-dir", str(tmp_path)]) == 0
    assert seen["staged"] is True and seen["base"]["switches"] == "STAGED"
    assert seen["out_dir"] == str(tmp_path / "STAGED") == seen["ncu"][0] and seen["ncu"][1] == ["STAGED"]
    seen.clear()
    assert switches.current().staged is False  # the switch held for main's parts alone
    assert profile_kernels.main(["--parts", "kernels", "--out-dir", str(tmp_path)]) == 0
    assert seen["staged"] is False and seen["base"]["switches"] == "" and seen["out_dir"] == str(tmp_path)


def test_one_call_runs_forward_and_backward_of_the_op():
    from repro.common.timing import one_call
    from repro.kernels.causal_product.reference import causal_dot_product_naive

    (q, k, v), up = profile_kernels.inputs(1, 2, 9, 4, 3, torch.float64, torch.device("cpu"), grad=True)
    seen = []
    op = lambda *x: seen.append(1) or causal_dot_product_naive(*x)
    one_call(op, (q, k, v), up, backward=True)()
    one_call(op, (q, k, v), up, backward=False)()
    assert len(seen) == 2


def test_group_counts_run_from_one_group_to_many_each_count_once():
    from repro.kernels.plumbing import cuda_grid

    for n_chunks in (1, 5, 64, 256, 1024):
        counts = profile_kernels.group_counts(n_chunks)
        assert counts[-1] == n_chunks and len(set(counts)) == len(counts)  # cpg = n_chunks: one group
        groups = [cuda_grid.grid(64, n_chunks * cuda_grid.CHUNK, 64, 132, c)[1] for c in counts]
        assert groups == sorted(set(groups), reverse=True) and groups[-1] == 1 and groups[0] <= 64


def test_layer_part_times_each_layer_and_counts_its_kernels(tmp_path, monkeypatch):
    """The layer part on a CPU, its CUDA timers replaced: each layer's forward + backward runs at
    the MNIST model's shape (the gradients reach x and the weights) and becomes a row."""
    import argparse

    from repro.common.results import provenance

    seen = []

    def fake_profile(fn, calls):
        fn()
        seen.append(calls)
        return [{"kernel": "k", "us_per_call": 1.0, "launches_per_call": 3.0, "share": 1.0}]

    monkeypatch.setattr(timing, "repeat", lambda fn, **kw: (fn(), timing.Timings(2.5 / 1e3, []))[1])
    monkeypatch.setattr(profile_kernels, "profile_pass", fake_profile)
    monkeypatch.setattr(profile_kernels, "LAYERS", (("softmax", None), ("linear", "torch")))
    args = argparse.Namespace(dtypes=["fp32"])
    profile_kernels.layer_part(args, provenance(torch.device("cpu")), str(tmp_path), None, torch.device("cpu"))
    import pandas as pd
    df = pd.read_csv(tmp_path / "layer.csv")
    assert list(df.attention) == ["softmax", "linear"] and list(df.kernel) == ["dispatcher", "torch"]
    assert (df.ms == 2.5).all() and (df.kernels_per_call == 3.0).all() and (df.n == 784).all()
    assert seen == [5, 5]


def test_model_part_trains_each_model_a_step_and_writes_its_kernels(tmp_path, monkeypatch):
    """The model part on a CPU (a small model; the CUDA timers replaced): each attention's model
    takes real training steps (its weights change), and model.csv / model_kernels.csv get a row
    per attention and per kernel."""
    import argparse

    import pandas as pd

    from repro.common.results import provenance

    before, dropouts = {}, []

    def fake_profile(fn, calls):
        model, opt, _ = fn.__defaults__  # the step's model and optimizer, bound as defaults
        assert type(model).__name__ == "PixelTransformer" and id(model) not in before
        # step 6's choices (paper_mnist with paper_authors): concatenated positions, the authors' RAdam,
        # softmax's attention dropout
        assert model.embedding == "concat" and type(opt).__name__ == "RAdam"
        assert opt.defaults["max_grad_norm"] == 1.0 and opt.defaults["weight_decay"] == 0.01
        dropouts.append({getattr(m, "attention_dropout", None) for m in model.modules()} - {None})
        before[id(model)] = [p.detach().clone() for p in model.parameters()]
        fn()
        assert any(not torch.equal(a, b) for a, b in zip(before[id(model)], model.parameters()))  # it trained
        return [{"kernel": "gemm", "us_per_call": 1500.0, "launches_per_call": 40.0, "share": 0.75},
                {"kernel": "elu", "us_per_call": 500.0, "launches_per_call": 2.0, "share": 0.25}]

    monkeypatch.setattr(timing, "repeat", lambda fn, **kw: (fn(), timing.Timings(31.0 / 1e3, []))[1])
    monkeypatch.setattr(profile_kernels, "profile_pass", fake_profile)
    monkeypatch.setattr(profile_kernels, "MODEL", {**profile_kernels.MODEL, "n_layers": 1, "d_model": 16, "d_ff": 32})
    monkeypatch.setattr(profile_kernels, "VALUES", 20)
    profile_kernels.model_part(argparse.Namespace(), provenance(torch.device("cpu")), str(tmp_path), None,
                               torch.device("cpu"))
    df, kernels = pd.read_csv(tmp_path / "model.csv"), pd.read_csv(tmp_path / "model_kernels.csv")
    assert list(df.attention) == ["softmax", "linear"] and (df.ms_per_step == 31.0).all()
    assert (df.busy_ms_per_step == 2.0).all() and (df.kernels_per_step == 42.0).all() and (df.n == 19).all()
    assert list(kernels.attention) == ["softmax", "softmax", "linear", "linear"] and len(before) == 2
    assert dropouts == [{0.1}, set()]  # softmax's layers drop 10 % of their weights; linear has none


def test_host_paths_call_each_layer_of_the_launch_path():
    """Each host path calls what it names: the bare launch on (BH, N, X) tensors, the op without
    autograd, the backward op directly, and the op through autograd (with gradients)."""
    from repro.kernels.causal_product.reference import causal_dot_product_naive

    calls = []

    def op(q, k, v):
        calls.append(("op", torch.is_grad_enabled() and q.requires_grad))
        return causal_dot_product_naive(q, k, v)

    fake = SimpleNamespace(
        launch=lambda q, k, v: calls.append(("launch", q.dim())),
        causal_dot_product=op,
        cdp_backward=lambda q, k, v, g: calls.append(("op_bwd", q.requires_grad, g.shape == v.shape)))
    (q, k, v), up = profile_kernels.inputs(1, 2, 9, 4, 3, torch.float64, torch.device("cpu"), grad=True)
    paths = profile_kernels.host_paths(fake, q, k, v, up)
    assert list(paths) == ["launch", "op_fwd", "op_bwd", "fwd", "fwd_bwd"]
    for fn in paths.values():
        fn()
    assert calls == [("launch", 3), ("op", False), ("op_bwd", False, True), ("op", True), ("op", True)]


def test_variants_part_interleaves_the_switches_and_restores_them(tmp_path, monkeypatch):
    """Each round times every variant in turn (forward launch and backward op), compares each
    one's outputs with the plain kernel's, and leaves the switches as it found them."""
    import argparse

    import pandas as pd

    from repro.common.results import provenance
    from repro.kernels.plumbing import switches

    seen = []

    def launch(q, k, v, tensor_cores):
        on = switches.current()
        seen.append(tuple(name for name in profile_kernels.SWITCHES if getattr(on, name.lower())))
        return (q + (1.0 if on.vec_loads and on.bare_smem else 0.0), None)  # one differs

    def backward(q, k, v, g):
        return q, k, v * (2.0 if switches.current().staged else 1.0)  # and one differs in the backward only

    fake = SimpleNamespace(launch=launch, cdp_backward=backward)
    was = switches.Switches(bare_smem=True, vec_loads=False, staged=True)
    monkeypatch.setattr(timing, "repeat", lambda fn, **kw: (fn(), timing.Timings(1.5 / 1e3, []))[1])
    args = argparse.Namespace(lengths=[16, 32])
    with switches.switched("bare_smem,staged"):
        profile_kernels.variants_part(args, provenance(torch.device("cpu")), str(tmp_path), fake, torch.device("cpu"))
        assert switches.current() == was
    df = pd.read_csv(tmp_path / "tc_variants.csv")
    n_var = len(profile_kernels.VARIANTS)
    assert len(df) == 2 * 3 * n_var * 2 and list(df["round"][:2 * n_var]) == [0] * 2 * n_var
    assert list(df["pass"][:4]) == ["fwd", "bwd", "fwd", "bwd"]
    assert list(df.variant[::2][:n_var]) == ["plain", "BARE_SMEM", "VEC_LOADS", "BARE_SMEM+VEC_LOADS", "STAGED"]
    first = df[df["round"] == 0]
    assert list(first.same_output[first["pass"] == "fwd"]) == [True, True, True, False, True] * 2  # both lengths
    assert list(first.same_output[first["pass"] == "bwd"]) == [True, True, True, True, False] * 2
    assert list(first.staged[first["pass"] == "fwd"]) == ([False] * 4 + [True]) * 2
    assert set(seen) == set(profile_kernels.VARIANTS)
