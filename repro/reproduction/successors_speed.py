"""The successors' ops against the causal product on a CPU (their speed targets): forward +
backward at B = 1, H = 8, D = M = 64, N = --pass-length, fp32, timed interleaved with
causal_dot_product by repro.reproduction.cpu_speed (its `successors` rows):
  retention  gated_causal_dot_product, RetNet's fixed decay per head (no gradient: fixed), <= 2x
  gla        gated_causal_dot_product, GLA-like decays per key dimension (log sigmoid / 16), <= 4x
  delta      delta_rule_dot_product, unit keys and beta in (0, 1), <= 4x
each row with x_causal = its time / the causal product's (the dispatcher's: on a CPU the fused C
kernel where it builds) and, where that is the fused kernel, x_causal_torch = its time / the
causal product's chunked PyTorch pieces (causal_torch, REPRO_KERNEL=torch): the same kind of
implementation as the successors' ops, the targets' reference (they were set when the causal
product had no other CPU path), and whether it is met."""
import torch
import torch.nn.functional as F

from repro.common import timing
from repro.kernels import causal_dot_product, delta_rule_dot_product, gated_causal_dot_product
from repro.kernels.plumbing.backend import forcing

TARGETS = {"retention": 2.0, "gla": 4.0, "delta": 4.0}  # at most this many times the causal product


def successor_fns(n, b=1, h=8, d=64, seed=0, torch_pieces=False):
    """name -> a forward + backward call, on the same q, k, v (causal, retention, gla, delta; and
    with torch_pieces causal_torch, the product on its PyTorch pieces: REPRO_KERNEL=torch)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) * 0.5 for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=g)
    unit_k = F.normalize(k, dim=-1)
    log_gamma = (1 - 2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32))).log()[:, None].expand(b, h, n)
    log_alpha = F.logsigmoid(torch.randn(b, h, n, d, generator=g)) / 16
    beta = torch.sigmoid(torch.randn(b, h, n, generator=g))
    q, k, v, unit_k, log_alpha, beta = (x.requires_grad_() for x in (q, k, v, unit_k, log_alpha, beta))

    def run(fn, *xs):
        return lambda: torch.autograd.grad(fn(*xs), [x for x in xs if x.requires_grad], grad)

    fns = {"causal": run(causal_dot_product, q, k, v),
            "retention": run(gated_causal_dot_product, q, k, v, log_gamma),
            "gla": run(gated_causal_dot_product, q, k, v, log_alpha),
            "delta": run(delta_rule_dot_product, q, unit_k, v, beta)}
    if torch_pieces:
        causal = fns["causal"]

        def causal_torch():
            with forcing("torch"):
                causal()
        fns["causal_torch"] = causal_torch
    return fns


def successor_rows(args, torch_pieces=False) -> list[dict]:
    """The `successors` measure's fields, a dict per op, the ops timed interleaved (--rounds,
    --settle); torch_pieces: the causal product has another path here, its PyTorch pieces, timed
    beside it as the targets' reference."""
    n = args.pass_length
    t = timing.interleaved(successor_fns(n, torch_pieces=torch_pieces), args.rounds, settle=args.settle)
    causal = t["causal"][0]
    ref, ref_name = (t["causal_torch"][0], "causal_torch") if "causal_torch" in t else (causal, "causal")
    rows = []
    for name, (sec, times) in t.items():
        extra = {}
        if name not in ("causal", "causal_torch"):
            extra = {"x_causal": sec / causal, "target": f"<= {TARGETS[name]:g}x {ref_name}",
                     "met": sec / ref <= TARGETS[name]}
            if ref_name == "causal_torch":
                extra["x_causal_torch"] = sec / ref
        rows.append(dict(measure="successors", pass_="fwd_bwd", method=name, n=n, batch=1, heads=8, d=64, m=64,
                         status="ok", ms=1e3 * sec, times_ms=[1e3 * x for x in times], **extra))
    return rows
