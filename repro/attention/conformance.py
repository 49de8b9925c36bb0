"""Does an attention behave as the suite expects? The checks behind task=conformance, for the
suite's attentions and a user's class alike, on small random inputs in float64 and float32.

Every layer is checked in eval mode (no dropout, no redrawing of LSH planes or random
features) and every call runs under the same fixed seed, so an attention that still draws
random numbers inside its forward (LSH with redraw: always) draws the same ones in each of the
calls a comparison makes; `repeatable` checks that this made its calls reproducible. The
float32 and float64 layers are copies of one layer, so they hold the same weights and the
same random features.
"""
import contextlib
import copy
import inspect
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from repro.attention.base import AttentionLayer
from repro.common.errors import ConfigError

PROPERTIES = ("interface", "repeatable", "causality", "padding invariance", "recurrent == parallel",
              "float32 == float64", "gradients")
# Largest deviation allowed, relative to the largest |output| (or |gradient|) of the compared call.
# Causality and padding: what cannot depend on the changed input must not move beyond rounding.
EXACT = {torch.float64: 1e-10, torch.float32: 1e-5}
# The step against the causal forward: two algorithms, so rounding of each.
RECURRENT = {torch.float64: 1e-8, torch.float32: 1e-4}
# float32 against float64, outputs and every gradient (a gradient's error relative to the larger
# of its own scale and 1% of the layer's largest gradient: one that cancels to ~0 in float64
# keeps the float32 rounding of its terms).
FP32_FORWARD, FP32_BACKWARD = 1e-4, 1e-3
# A gradient whose largest entry is below this fraction of the layer's largest is rounding: the
# attention is invariant to that parameter (softmax to the key bias), reported, not failed.
ROUNDING = 1e-10


@dataclass
class Check:
    property: str
    result: str  # pass | fail | skip | not run
    detail: str


def _refusal(err) -> bool:
    """Is this exception the attention declining a form (a non-causal attention asked for
    causal=True, a gated one for causal=False), rather than a bug?"""
    return isinstance(err, (ConfigError, NotImplementedError)) or (isinstance(err, ValueError)
                                                                  and "causal" in str(err))


def _line(err) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[-1]


def _rel(a, b, scale) -> float:
    """max |a - b| / scale, in float64 (0 when both are all zeros)."""
    diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _scale(t) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


class Conformance:
    """check() -> [Check] for the layer that `factory(d_model=..., n_heads=...)` builds."""

    def __init__(self, factory, d_model: int, n_heads: int, batch: int = 3, length: int = 37, seed: int = 0,
                 device: torch.device | str = "cpu"):
        if batch < 2 or length < 4:
            raise ConfigError(f"conformance: batch={batch}, length={length}: need batch >= 2 (a padded and an "
                              f"unpadded sequence) and length >= 4 (positions before and after a perturbation)")
        self.factory, self.d_model, self.n_heads = factory, d_model, n_heads
        self.batch, self.length, self.seed, self.device = batch, length, seed, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)  # the inputs' own stream, apart from the layer's calls

    # ------------------------------------------------------------------ helpers

    def _randn(self, *shape, dtype=torch.float64):
        # drawn in float32 and widened: cast back to float32 it is exact, so both dtypes can see one input
        return torch.randn(*shape, generator=self.gen).to(self.device, dtype)

    def _call(self, fn):
        """fn() under the fixed seed: the layer's random draws, if any, are the same every call."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.seed)
            return fn()

    def forward(self, layer, x, causal, mask=None):
        return self._call(lambda: layer(x, causal=causal, key_padding_mask=mask))

    def steps(self, layer, x):
        def run():
            state, ys = None, []
            for t in range(x.shape[1]):
                y, state = layer.step(x[:, t], state)
                ys.append(y)
            return torch.stack(ys, 1)  # (B, N, d_model)
        return self._call(run)

    def padding_mask(self):
        """bool (B, N), True at the padded tail: one sequence whole, the others shorter."""
        n = self.length
        lengths = [n] + [max(1, n * (self.batch - i) // (self.batch + 1)) for i in range(1, self.batch)]
        return torch.arange(n, device=self.device)[None, :] >= torch.tensor(lengths, device=self.device)[:, None]

    # ------------------------------------------------------------------ the checks

    def check(self) -> list[Check]:
        torch.manual_seed(self.seed)
        self.layer = self.factory(d_model=self.d_model, n_heads=self.n_heads)
        with _full_float32():
            out = [self.interface()]
            if out[0].result == "fail":
                return out + [Check(p, "not run", "the interface failed") for p in PROPERTIES[1:]]
            return out + [self.repeatable(), self.causality(), self.padding(), self.recurrent(), self.precision(),
                          self.gradients()]

    def interface(self) -> Check:
        layer = self.layer
        if not isinstance(layer, nn.Module):
            return Check("interface", "fail", f"built a {type(layer).__name__}, not a torch.nn.Module")
        if isinstance(layer, AttentionLayer):
            kind = "an AttentionLayer"
        else:
            params = inspect.signature(layer.forward).parameters
            missing = [p for p in ("causal", "key_padding_mask") if p not in params]
            if missing:
                return Check("interface", "fail", f"{type(layer).__name__}.forward takes no {', '.join(missing)}: "
                                                  f"forward(x, causal=..., key_padding_mask=...) is the call")
            kind = "not an AttentionLayer, same call"
        self.layers = {dt: copy.deepcopy(layer).to(self.device, dt).eval() for dt in (torch.float64, torch.float32)}
        self.forms, self.refused = [], {}
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            for causal in (True, False):
                try:
                    y = self.forward(layer, x, causal)
                except Exception as err:  # noqa: BLE001 (a refusal is an answer; anything else fails the check)
                    if not _refusal(err):
                        return Check("interface", "fail", f"forward(causal={causal}) in {_name(dtype)}: "
                                                          f"{type(err).__name__}: {_line(err)}")
                    self.refused[causal] = _line(err)
                    continue
                bad = self._bad_output(y, x, (self.batch, self.length, self.d_model))
                if bad:
                    return Check("interface", "fail", f"forward(causal={causal}) in {_name(dtype)}: {bad}")
                if dtype == torch.float64:
                    self.forms.append(causal)
        if not self.forms:
            return Check("interface", "fail", f"neither form runs: {self.refused[True]}; {self.refused[False]}")
        # an AttentionLayer says `recurrent` (its base has a step that refuses); another class, by having a step
        self.has_step = bool(getattr(self.layer, "recurrent", not isinstance(self.layer, AttentionLayer)
                                     and callable(getattr(self.layer, "step", None))))
        if self.has_step:
            for dtype, layer in self.layers.items():
                x = self._randn(self.batch, self.d_model, dtype=dtype)
                try:
                    got = self._call(lambda layer=layer, x=x: layer.step(x, None))
                except Exception as err:  # noqa: BLE001
                    return Check("interface", "fail", f"step(x_t, None) in {_name(dtype)}: "
                                                      f"{type(err).__name__}: {_line(err)}")
                if not (isinstance(got, tuple) and len(got) == 2):
                    return Check("interface", "fail", "step(x_t, state) must return (y_t, state)")
                bad = self._bad_output(got[0], x, (self.batch, self.d_model))
                if bad:
                    return Check("interface", "fail", f"step in {_name(dtype)}: {bad}")
        forms = " and ".join(_form(c) for c in self.forms)
        return Check("interface", "pass", f"{kind}; {forms} forward; "
                                          + ("a recurrent step" if self.has_step else "no step"))

    @staticmethod
    def _bad_output(y, x, shape):
        if not isinstance(y, torch.Tensor):
            return f"returned a {type(y).__name__}, not a tensor"
        if tuple(y.shape) != shape or y.dtype != x.dtype:
            return f"returned {_name(y.dtype)} {tuple(y.shape)}, expected {_name(x.dtype)} {shape}"
        if not torch.isfinite(y).all():
            return "returned non-finite values"
        return None

    def _draws(self, layer, x, causal) -> bool:
        """Does one call in eval mode draw random numbers (LSH with redraw: always)?"""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.seed)
            before = [torch.random.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]
            layer(x, causal=causal, key_padding_mask=None)
            after = [torch.random.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]
        return any(not torch.equal(a, b) for a, b in zip(before, after))

    def repeatable(self) -> Check:
        worst, self.draws = {}, False
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            worst[dtype] = 0.0
            for causal in self.forms:
                y1, y2 = self.forward(layer, x, causal), self.forward(layer, x, causal)
                worst[dtype] = max(worst[dtype], _rel(y1, y2, _scale(y1)))
                self.draws = self.draws or self._draws(layer, x, causal)
            if worst[dtype] > EXACT[dtype]:
                return Check("repeatable", "fail", f"two calls on the same input, same seed, in eval mode differ by "
                                                   f"{worst[dtype]:.1e} in {_name(dtype)}: the other comparisons "
                                                   f"would not be fair")
        drawn = "; it draws random numbers in every call (the same ones under the seed)" if self.draws else ""
        return Check("repeatable", "pass", f"eval mode, one seed for every call: the same outputs{drawn}")

    def causality(self) -> Check:
        if True not in self.forms:
            return Check("causality", "skip", f"no causal form ({self.refused.get(True)})")
        worst, where = {}, ""
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype).requires_grad_(True)
            y = self.forward(layer, x, True)
            scale, worst[dtype] = _scale(y), 0.0
            for t in sorted({1, self.length // 2, self.length - 1}):
                x2 = x.detach().clone()
                x2[:, t] += 3 * self._randn(self.batch, self.d_model, dtype=dtype)
                y2 = self.forward(layer, x2, True)
                past, moved = _rel(y2[:, :t], y[:, :t], scale), _rel(y2[:, t:], y[:, t:], scale)
                if moved == 0:
                    return Check("causality", "fail", f"changing x at t={t} changed no output: the check cannot see "
                                                      f"an attention that ignores its input")
                # backward too: no gradient of an output before t reaches x at t or later
                w = self._randn(*y.shape, dtype=dtype)
                g, = torch.autograd.grad((y[:, :t] * w[:, :t]).sum(), x, retain_graph=True)
                leak = _rel(g[:, t:], torch.zeros_like(g[:, t:]), _scale(g))
                if max(past, leak) > worst[dtype]:
                    worst[dtype], where = max(past, leak), f" (t={t}, {_name(dtype)})"
                if past > EXACT[dtype] or leak > EXACT[dtype] or not torch.isfinite(g).all():
                    what = "outputs" if past > EXACT[dtype] else "gradients"
                    return Check("causality", "fail", f"changing x at t={t} moved {what} before t by "
                                                      f"{max(past, leak):.1e} of their scale in {_name(dtype)} "
                                                      f"(allowed {EXACT[dtype]:.0e}): the causal form sees the future")
        return Check("causality", "pass", f"x changed at 3 positions: earlier outputs and gradients moved at most "
                                          f"{max(worst.values()):.1e}{where} (allowed {_tolerances(EXACT)})")

    def padding(self) -> Check:
        if False not in self.forms:
            return Check("padding invariance", "skip", f"no non-causal form ({self.refused.get(False)})")
        mask = self.padding_mask()
        if not getattr(self.layer, "supports_key_padding_mask", True):
            try:
                self.forward(self.layers[torch.float64], self._randn(self.batch, self.length, self.d_model), False,
                             mask)
            except (ValueError, NotImplementedError):
                return Check("padding invariance", "skip", "supports_key_padding_mask = False, and a mask is refused")
            return Check("padding invariance", "fail", "supports_key_padding_mask = False, yet a mask is taken "
                                                       "silently")
        worst = {}
        real = ~mask[..., None]  # (B, N, 1)
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            x2 = torch.where(mask[..., None], 10 * self._randn(*x.shape, dtype=dtype), x)  # other padded contents
            w = self._randn(*x.shape, dtype=dtype) * real
            ys, gs = [], []
            for inp in (x, x2):
                inp = inp.clone().requires_grad_(True)
                y = self.forward(layer, inp, False, mask)
                if not torch.isfinite(y).all():
                    return Check("padding invariance", "fail",
                                 f"non-finite outputs with a padding mask in {_name(dtype)}")
                g, = torch.autograd.grad((y * w).sum(), inp)
                ys.append(y * real)
                gs.append(g)
            moved = _rel(ys[0], ys[1], _scale(ys[0]))
            leak = _rel(gs[0] * mask[..., None], torch.zeros_like(gs[0]), _scale(gs[0]))
            worst[dtype] = max(moved, leak)
            if worst[dtype] > EXACT[dtype]:
                what = "real outputs" if moved > EXACT[dtype] else "gradients of the real outputs at padded frames"
                return Check("padding invariance", "fail", f"changing the padded frames moved the {what} by "
                                                           f"{worst[dtype]:.1e} of their scale in {_name(dtype)} "
                                                           f"(allowed {EXACT[dtype]:.0e})")
        lengths = (~mask).sum(1).tolist()
        return Check("padding invariance", "pass", f"lengths {lengths}: other padded contents moved real outputs and "
                                                   f"gradients at most {max(worst.values()):.1e} "
                                                   f"(allowed {_tolerances(EXACT)})")

    def recurrent(self) -> Check:
        if not self.has_step:
            return Check("recurrent == parallel", "skip", "no step (recurrent = False): generation re-runs the prefix")
        if True not in self.forms:
            return Check("recurrent == parallel", "fail", "a step but no causal forward to compare it with")
        worst = {}
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            with torch.no_grad():
                y, s = self.forward(layer, x, True), self.steps(layer, x)
            worst[dtype] = _rel(s, y, _scale(y))
            if not worst[dtype] <= RECURRENT[dtype]:
                return Check("recurrent == parallel", "fail", f"step by step differs from the causal forward by "
                                                              f"{worst[dtype]:.1e} of its scale in {_name(dtype)} "
                                                              f"(allowed {RECURRENT[dtype]:.0e})")
        return Check("recurrent == parallel", "pass", f"{self.length} steps against the causal forward: "
                                                      f"{worst[torch.float64]:.1e} (float64), "
                                                      f"{worst[torch.float32]:.1e} (float32) of the output's scale "
                                                      f"(allowed {_tolerances(RECURRENT)})")

    def _forward_backward(self, dtype, x, w, causal):
        layer = self.layers[dtype]
        x = x.to(dtype).requires_grad_(True)
        y = self.forward(layer, x, causal)
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = torch.autograd.grad((y * w.to(dtype)).sum(), [x] + params, allow_unused=True)
        return y, grads

    def precision(self) -> Check:
        fwd, bwd, names = 0.0, 0.0, ["x"] + [n for n, p in self.layer.named_parameters() if p.requires_grad]
        worst_name = ""
        for causal in self.forms:
            x = self._randn(self.batch, self.length, self.d_model)
            w = self._randn(self.batch, self.length, self.d_model)
            y64, g64 = self._forward_backward(torch.float64, x, w, causal)
            y32, g32 = self._forward_backward(torch.float32, x, w, causal)
            fwd = max(fwd, _rel(y32, y64, _scale(y64)))
            floor = 0.01 * max((_scale(g) for g in g64 if g is not None), default=0.0)
            for name, a, b in zip(names, g32, g64):
                if a is None or b is None:
                    continue  # unreached: the gradients check names it
                err = _rel(a, b, max(_scale(b), floor))
                if err > bwd:
                    bwd, worst_name = err, f" ({name}, {_form(causal)})"
        numbers = (f"forward {fwd:.1e} (allowed {FP32_FORWARD:.0e}), backward {bwd:.1e}{worst_name} "
                   f"(allowed {FP32_BACKWARD:.0e}), relative to the float64 scale")
        if fwd <= FP32_FORWARD and bwd <= FP32_BACKWARD:
            return Check("float32 == float64", "pass", numbers)
        if self.draws:  # one seed gives float32 and float64 draws that differ: no fair comparison
            return Check("float32 == float64", "skip", f"not comparable: it draws random numbers in every call, "
                                                       f"and one seed draws other ones in float32 and float64 "
                                                       f"({numbers}); a setting that draws once in eval mode "
                                                       f"(lsh: redraw=train) makes it comparable")
        return Check("float32 == float64", "fail", numbers)

    def gradients(self) -> Check:
        named = [(n, p) for n, p in self.layer.named_parameters() if p.requires_grad]
        if not named:
            return Check("gradients", "skip", "no trainable parameters")
        grads = [None] * len(named)
        for causal in self.forms:
            x = self._randn(self.batch, self.length, self.d_model)
            w = self._randn(self.batch, self.length, self.d_model)
            _, (gx, *gp) = self._forward_backward(torch.float64, x, w, causal)
            if not torch.isfinite(gx).all():
                return Check("gradients", "fail", f"non-finite gradient of the input ({_form(causal)})")
            grads = [a if b is None else b.abs() if a is None else a + b.abs() for a, b in zip(grads, gp)]
        unreached = [n for (n, _), g in zip(named, grads) if g is None]
        bad = [n for (n, _), g in zip(named, grads) if g is not None and not torch.isfinite(g).all()]
        zero = [n for (n, _), g in zip(named, grads) if g is not None and not g.any()]
        if unreached or bad or zero:
            parts = [f"{what}: {', '.join(ns)}" for what, ns in (("no gradient reaches", unreached),
                                                                 ("non-finite", bad), ("all zero", zero)) if ns]
            return Check("gradients", "fail", "; ".join(parts))
        top = max(_scale(g) for g in grads)
        tiny = [n for (n, _), g in zip(named, grads) if _scale(g) <= ROUNDING * top]
        note = (f"; at rounding level (the attention is invariant to them): {', '.join(tiny)}" if tiny else "")
        return Check("gradients", "pass", f"{len(named)} parameters, every one reached, finite and non-zero "
                                          f"(forms: {', '.join(_form(c) for c in self.forms)}){note}")


@contextlib.contextmanager
def _full_float32():
    """float32 as float32 on a GPU: TF32 matmuls and convolutions (10-bit mantissas) off while
    checking, so float32 == float64 measures the attention's arithmetic, not the device's setting."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _form(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tolerances(table) -> str:
    return f"{table[torch.float64]:.0e} float64, {table[torch.float32]:.0e} float32"


def check(factory, d_model: int, n_heads: int, **kw) -> list[dict]:
    """The conformance table of the layer factory(d_model=..., n_heads=...) builds: one
    {property, result, detail} per property, in PROPERTIES order."""
    return [asdict(c) for c in Conformance(factory, d_model, n_heads, **kw).check()]


def first_failure(table) -> dict | None:
    return next((row for row in table if row["result"] == "fail"), None)
