"""Does an attention behave as the suite expects? The checks behind task=conformance, for the
suite's attentions and a user's class alike, on small random inputs in float64 and float32.

The comparisons run in eval mode and again in train mode, on a copy whose dropout is set to 0
(every torch Dropout module and every float attribute named like one): what training runs must
conform too. Every call runs under the same fixed seed (torch's, numpy's and Python's), so an
attention that draws random numbers inside its forward (LSH redraws its planes in every
training call, and with redraw=always in eval too) draws the same ones in each of the calls a
comparison makes; `repeatable` checks that this made its calls reproducible, and names an
attention that is random by design in training. The float32 and float64 layers are copies of
one layer, so they hold the same weights and the same random features. The default length,
131 tokens, runs past the block sizes the attentions cut a sequence into (32, 64, 128), so a
fault that starts at a later block is seen.

Whatever the attention raises inside a check (a SystemExit too: every BaseException but
KeyboardInterrupt) fails that check, naming it; the table is always complete. How a layer is
called (the contract, the seed, dropout to 0): repro.attention.contract; the checks that change
part of the input (causality, padding invariance, batch independence): repro.attention.invariance.
"""
import contextlib
import copy
from dataclasses import asdict

import torch

from repro.attention.base import AttentionLayer, is_recurrent
from repro.attention.contract import call, contract_gap, describe, drew, rng_states, zero_dropout
from repro.attention.invariance import EXACT, Check, Invariances, dtype_name, form_name, magnitude, rel, tolerances
from repro.common.errors import ConfigError

PROPERTIES = ("interface", "repeatable", "causality", "padding invariance", "batch independence",
              "recurrent == parallel", "float32 == float64", "gradients")
LENGTH = 131  # tokens: past two blocks of 64 and one of 128, and a prime (no chunk size divides it)
MODES = ("eval", "train")
DTYPES = (torch.float64, torch.float32)
# Largest deviation allowed, relative to the largest |output| (or |gradient|) of the compared call
# (what may not move at all: repro.attention.invariance.EXACT).
# The step against the causal forward: two algorithms, so rounding of each.
RECURRENT = {torch.float64: 1e-8, torch.float32: 1e-4}
# float32 against float64, outputs and every gradient (a gradient's error relative to the larger
# of its own scale and 1% of the layer's largest gradient: one that cancels to ~0 in float64
# keeps the float32 rounding of its terms).
FP32_FORWARD, FP32_BACKWARD = 1e-4, 1e-3
# A gradient whose largest entry is below this fraction of the layer's largest is rounding: the
# attention is invariant to that parameter (softmax to the key bias), reported, not failed.
ROUNDING = 1e-10


def _refusal(err) -> bool:
    """Is this exception the attention declining a form (a non-causal attention asked for
    causal=True, a gated one for causal=False), rather than a bug?"""
    return isinstance(err, (ConfigError, NotImplementedError)) or (isinstance(err, ValueError)
                                                                  and "causal" in str(err))


def _line(err) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[-1]


class Conformance(Invariances):
    """check() -> [Check] for the layer that `factory(d_model=..., n_heads=...)` builds."""

    def __init__(self, factory, d_model: int, n_heads: int, batch: int = 3, length: int = LENGTH, seed: int = 0,
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
        return call(fn, self.seed, self.device)

    def forward(self, layer, x, causal, mask=None):
        return self._call(lambda: layer(x, causal=causal, key_padding_mask=mask))

    def _grad(self, out, inputs, retain_graph=False, allow_unused=False):
        """torch.autograd.grad as a check calls it: the attention's backward is its code too."""
        return self._call(lambda: torch.autograd.grad(out, inputs, retain_graph=retain_graph,
                                                      allow_unused=allow_unused))

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

    def _runs(self):
        """(mode, dtype, layer, where) of every comparison: eval and train mode, float64 and float32."""
        return [(mode, dt, (self.layers if mode == "eval" else self.trained)[dt], f"{dtype_name(dt)}, {mode} mode")
                for mode in MODES for dt in DTYPES]

    # ------------------------------------------------------------------ the checks

    def check(self) -> list[Check]:
        with _full_float32():
            try:
                self.layer = self._call(lambda: self.factory(d_model=self.d_model, n_heads=self.n_heads))
            except ConfigError:
                raise  # a setting of the config: one line from the run, not a row
            except Exception as err:
                out = [Check("interface", "fail", f"building it as the model does, Class(d_model={self.d_model}, "
                                                  f"n_heads={self.n_heads}): {describe(err)}")]
            else:
                out = [self._run("interface", self.interface)]
            if out[0].result == "fail":
                return out + [Check(p, "not run", "the interface failed") for p in PROPERTIES[1:]]
            return out + [self._run(p, fn) for p, fn in (
                ("repeatable", self.repeatable), ("causality", self.causality), ("padding invariance", self.padding),
                ("batch independence", self.batch_independence), ("recurrent == parallel", self.recurrent),
                ("float32 == float64", self.precision), ("gradients", self.gradients))]

    @staticmethod
    def _run(prop, fn) -> Check:
        """One check; whatever a call it makes raises fails it, in one line."""
        try:
            return fn()
        except Exception as err:
            return Check(prop, "fail", f"raised {describe(err)}")

    def interface(self) -> Check:
        layer = self.layer
        gap = contract_gap(layer)
        if gap:
            return Check("interface", "fail", gap)
        kind = "an AttentionLayer" if isinstance(layer, AttentionLayer) else "not an AttentionLayer, same call"
        # copies made before any call: the train-mode ones start from the same weights and draws
        self.layers = {dt: copy.deepcopy(layer).to(self.device, dt).eval() for dt in DTYPES}
        self.trained = {dt: copy.deepcopy(layer).to(self.device, dt).train() for dt in DTYPES}
        self.dropouts = zero_dropout(self.trained[torch.float64])
        zero_dropout(self.trained[torch.float32])
        self.forms, self.refused = [], {}
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            for causal in (True, False):
                try:
                    y = self.forward(layer, x, causal)
                except Exception as err:  # a refusal is an answer; anything else fails the check
                    if not _refusal(err):
                        return Check("interface", "fail", f"forward(causal={causal}) in {dtype_name(dtype)}: "
                                                          f"{describe(err)}")
                    self.refused[causal] = _line(err)
                    continue
                bad = self._bad_output(y, x, (self.batch, self.length, self.d_model))
                if bad:
                    return Check("interface", "fail", f"forward(causal={causal}) in {dtype_name(dtype)}: {bad}")
                if dtype == torch.float64:
                    self.forms.append(causal)
        if not self.forms:
            return Check("interface", "fail", f"neither form runs: {self.refused[True]}; {self.refused[False]}")
        # an AttentionLayer says `recurrent` (its base has a step that refuses); another class, by having a step
        self.has_step = is_recurrent(self.layer)
        if self.has_step:
            for dtype, layer in self.layers.items():
                x = self._randn(self.batch, self.d_model, dtype=dtype)
                try:
                    got = self._call(lambda layer=layer, x=x: layer.step(x, None))
                except Exception as err:
                    return Check("interface", "fail", f"step(x_t, None) in {dtype_name(dtype)}: {describe(err)}")
                if not (isinstance(got, tuple) and len(got) == 2):
                    return Check("interface", "fail", "step(x_t, state) must return (y_t, state)")
                bad = self._bad_output(got[0], x, (self.batch, self.d_model))
                if bad:
                    return Check("interface", "fail", f"step in {dtype_name(dtype)}: {bad}")
        forms = " and ".join(form_name(c) for c in self.forms)
        return Check("interface", "pass", f"{kind}; {forms} forward; "
                                          + ("a recurrent step" if self.has_step else "no step"))

    @staticmethod
    def _bad_output(y, x, shape):
        if not isinstance(y, torch.Tensor):
            return f"returned a {type(y).__name__}, not a tensor"
        if tuple(y.shape) != shape or y.dtype != x.dtype:
            return f"returned {dtype_name(y.dtype)} {tuple(y.shape)}, expected {dtype_name(x.dtype)} {shape}"
        if not torch.isfinite(y).all():
            return "returned non-finite values"
        return None

    def _forward_draws(self, layer, x, causal):
        """forward(x) and whether the call drew random numbers (LSH: in every training call; with
        redraw=always, in eval too)."""
        def call():
            before = rng_states(self.device)
            y = layer(x, causal=causal, key_padding_mask=None)
            return y, drew(before, rng_states(self.device))
        return self._call(call)

    def repeatable(self) -> Check:
        self.draws = dict.fromkeys(MODES, False)
        for mode, dtype, layer, where in self._runs():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            worst = 0.0
            for causal in self.forms:
                y1, (y2, draws) = self.forward(layer, x, causal), self._forward_draws(layer, x, causal)
                worst = max(worst, rel(y1, y2, magnitude(y1)))
                self.draws[mode] |= draws
            if worst > EXACT[dtype]:
                return Check("repeatable", "fail", f"two calls on the same input, same seed, differ by {worst:.1e} "
                                                   f"in {where}: the other comparisons would not be fair")
        zeroed = f", dropout set to 0 ({', '.join(self.dropouts)})" if self.dropouts else ""
        drawn = ("; it draws random numbers in every call (the same ones under the seed)" if self.draws["eval"]
                 else "; random by design in training: it draws random numbers in every training call (the same "
                      "ones under the seed)" if self.draws["train"] else "")
        return Check("repeatable", "pass", f"eval and train mode{zeroed}, one seed for every call: the same "
                                           f"outputs{drawn}")

    def recurrent(self) -> Check:
        if not self.has_step:
            return Check("recurrent == parallel", "skip", "no recurrent step: generation re-runs the prefix")
        if True not in self.forms:
            return Check("recurrent == parallel", "fail", "a step but no causal forward to compare it with")
        worst = {}
        for dtype, layer in self.layers.items():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            with torch.no_grad():
                y, s = self.forward(layer, x, True), self.steps(layer, x)
            worst[dtype] = rel(s, y, magnitude(y))
            if not worst[dtype] <= RECURRENT[dtype]:
                return Check("recurrent == parallel", "fail", f"step by step differs from the causal forward by "
                                                              f"{worst[dtype]:.1e} of its scale in {dtype_name(dtype)} "
                                                              f"(allowed {RECURRENT[dtype]:.0e})")
        return Check("recurrent == parallel", "pass", f"{self.length} steps against the causal forward: "
                                                      f"{worst[torch.float64]:.1e} (float64), "
                                                      f"{worst[torch.float32]:.1e} (float32) of the output's scale "
                                                      f"(allowed {tolerances(RECURRENT)})")

    def _forward_backward(self, dtype, x, w, causal):
        layer = self.layers[dtype]
        x = x.to(dtype).requires_grad_(True)
        y = self.forward(layer, x, causal)
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = self._grad((y * w.to(dtype)).sum(), [x] + params, allow_unused=True)
        return y, grads

    def precision(self) -> Check:
        fwd, bwd, names = 0.0, 0.0, ["x"] + [n for n, p in self.layer.named_parameters() if p.requires_grad]
        worst_name = ""
        for causal in self.forms:
            x = self._randn(self.batch, self.length, self.d_model)
            w = self._randn(self.batch, self.length, self.d_model)
            y64, g64 = self._forward_backward(torch.float64, x, w, causal)
            y32, g32 = self._forward_backward(torch.float32, x, w, causal)
            fwd = max(fwd, rel(y32, y64, magnitude(y64)))
            floor = 0.01 * max((magnitude(g) for g in g64 if g is not None), default=0.0)
            for name, a, b in zip(names, g32, g64):
                if a is None or b is None:
                    continue  # unreached: the gradients check names it
                err = rel(a, b, max(magnitude(b), floor))
                if err > bwd:
                    bwd, worst_name = err, f" ({name}, {form_name(causal)})"
        numbers = (f"forward {fwd:.1e} (allowed {FP32_FORWARD:.0e}), backward {bwd:.1e}{worst_name} "
                   f"(allowed {FP32_BACKWARD:.0e}), relative to the float64 scale")
        if fwd <= FP32_FORWARD and bwd <= FP32_BACKWARD:
            return Check("float32 == float64", "pass", numbers)
        if self.draws["eval"]:  # one seed gives float32 and float64 draws that differ: no fair comparison
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
                return Check("gradients", "fail", f"non-finite gradient of the input ({form_name(causal)})")
            grads = [a if b is None else b.abs() if a is None else a + b.abs() for a, b in zip(grads, gp)]
        unreached = [n for (n, _), g in zip(named, grads) if g is None]
        bad = [n for (n, _), g in zip(named, grads) if g is not None and not torch.isfinite(g).all()]
        zero = [n for (n, _), g in zip(named, grads) if g is not None and not g.any()]
        if unreached or bad or zero:
            parts = [f"{what}: {', '.join(ns)}" for what, ns in (("no gradient reaches", unreached),
                                                                 ("non-finite", bad), ("all zero", zero)) if ns]
            return Check("gradients", "fail", "; ".join(parts))
        top = max(magnitude(g) for g in grads)
        tiny = [n for (n, _), g in zip(named, grads) if magnitude(g) <= ROUNDING * top]
        note = (f"; at rounding level (the attention is invariant to them): {', '.join(tiny)}" if tiny else "")
        return Check("gradients", "pass", f"{len(named)} parameters, every one reached, finite and non-zero "
                                          f"(forms: {', '.join(form_name(c) for c in self.forms)}){note}")


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


def check(factory, d_model: int, n_heads: int, **kw) -> list[dict]:
    """The conformance table of the layer factory(d_model=..., n_heads=...) builds: one
    {property, result, detail} per property, in PROPERTIES order."""
    return [asdict(c) for c in Conformance(factory, d_model, n_heads, **kw).check()]


def first_failure(table) -> dict | None:
    return next((row for row in table if row["result"] == "fail"), None)
