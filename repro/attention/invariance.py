"""The half of the conformance check (repro.attention.conformance) that changes part of the input
and asks what moved: causality (x at a position moves no earlier output, nor its gradient),
padding invariance (padded frames move no real output or gradient) and batch independence
(one sequence moves no other's output or input gradient). Each runs in eval and in train mode
(dropout 0), in float64 and float32; what may not move must stay within rounding (EXACT). Also
the vocabulary both halves share: a row of the table (Check) and its numbers."""
import math
from dataclasses import dataclass

import torch

# Largest deviation allowed, relative to the largest |output| (or |gradient|) of the compared call.
# Causality and padding: what cannot depend on the changed input must not move beyond rounding.
EXACT = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclass
class Check:
    property: str
    result: str  # pass | fail | skip | not run
    detail: str


def rel(a, b, scale) -> float:
    """max |a - b| / scale, in float64 (0 when both are all zeros)."""
    diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def magnitude(t) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def form_name(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tolerances(table) -> str:
    return f"{table[torch.float64]:.0e} float64, {table[torch.float32]:.0e} float32"


class Invariances:
    """causality, padding and batch_independence, for Conformance: they read its layers (eval and
    train mode), its forms and its calls."""

    def causality(self) -> Check:
        if True not in self.forms:
            return Check("causality", "skip", f"no causal form ({self.refused.get(True)})")
        worst, where_worst = 0.0, ""
        ts = sorted({1, self.length // 2, self.length - 1})
        for _, dtype, layer, where in self._runs():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype).requires_grad_(True)
            y = self.forward(layer, x, True)
            scale, w = magnitude(y), self._randn(*y.shape, dtype=dtype)
            # backward too: no gradient of an output before t reaches x at t or later; every backward
            # before the next forward (rfa redraws its features in place in every training call)
            grads = {t: self._grad((y[:, :t] * w[:, :t]).sum(), x, retain_graph=t != ts[-1])[0] for t in ts}
            for t in ts:
                x2 = x.detach().clone()
                x2[:, t] += 3 * self._randn(self.batch, self.d_model, dtype=dtype)
                y2 = self.forward(layer, x2, True)
                past, moved = rel(y2[:, :t], y[:, :t], scale), rel(y2[:, t:], y[:, t:], scale)
                if moved == 0:
                    return Check("causality", "fail", f"changing x at t={t} changed no output in {where}: the check "
                                                      f"cannot see an attention that ignores its input")
                g = grads[t]
                leak = rel(g[:, t:], torch.zeros_like(g[:, t:]), magnitude(g))
                if max(past, leak) > worst:
                    worst, where_worst = max(past, leak), f" (t={t}, {where})"
                if past > EXACT[dtype] or leak > EXACT[dtype] or not torch.isfinite(g).all():
                    what = "outputs" if past > EXACT[dtype] else "gradients"
                    return Check("causality", "fail", f"changing x at t={t} moved {what} before t by "
                                                      f"{max(past, leak):.1e} of their scale in {where} "
                                                      f"(allowed {EXACT[dtype]:.0e}): the causal form sees the future")
        return Check("causality", "pass", f"x changed at t={', '.join(map(str, ts))}, eval and train mode: earlier "
                                          f"outputs and gradients moved at most {worst:.1e}{where_worst} "
                                          f"(allowed {tolerances(EXACT)})")

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
        worst = 0.0
        real = ~mask[..., None]  # (B, N, 1)
        for _, dtype, layer, where in self._runs():
            x = self._randn(self.batch, self.length, self.d_model, dtype=dtype)
            x2 = torch.where(mask[..., None], 10 * self._randn(*x.shape, dtype=dtype), x)  # other padded contents
            w = self._randn(*x.shape, dtype=dtype) * real
            ys, gs = [], []
            for inp in (x, x2):
                inp = inp.clone().requires_grad_(True)
                y = self.forward(layer, inp, False, mask)
                if not torch.isfinite(y).all():
                    return Check("padding invariance", "fail", f"non-finite outputs with a padding mask in {where}")
                g, = self._grad((y * w).sum(), inp)
                ys.append(y * real)
                gs.append(g)
            moved = rel(ys[0], ys[1], magnitude(ys[0]))
            leak = rel(gs[0] * mask[..., None], torch.zeros_like(gs[0]), magnitude(gs[0]))
            worst = max(worst, moved, leak)
            if max(moved, leak) > EXACT[dtype]:
                what = "real outputs" if moved > EXACT[dtype] else "gradients of the real outputs at padded frames"
                return Check("padding invariance", "fail", f"changing the padded frames moved the {what} by "
                                                           f"{max(moved, leak):.1e} of their scale in {where} "
                                                           f"(allowed {EXACT[dtype]:.0e})")
        lengths = (~mask).sum(1).tolist()
        return Check("padding invariance", "pass", f"lengths {lengths}, eval and train mode: other padded contents "
                                                   f"moved real outputs and gradients at most {worst:.1e} "
                                                   f"(allowed {tolerances(EXACT)})")

    def batch_independence(self) -> Check:
        """Another sequence in place of sequence j (each in turn) moves no other sequence's output,
        nor its input's gradient (of the whole batch's weighted outputs: a sequence whose output
        reads sequence j's input would see that gradient move too)."""
        worst, b = 0.0, self.batch
        for causal in self.forms:
            for _, dtype, layer, where in self._runs():
                x = self._randn(b, self.length, self.d_model, dtype=dtype).requires_grad_(True)
                w = self._randn(b, self.length, self.d_model, dtype=dtype)
                y = self.forward(layer, x, causal)
                g, = self._grad((y * w).sum(), x)  # before the next forward (rfa redraws in place in training)
                for j in range(b):
                    x2 = x.detach().clone()
                    x2[j] = 3 * self._randn(self.length, self.d_model, dtype=dtype)
                    x2.requires_grad_(True)
                    y2 = self.forward(layer, x2, causal)
                    g2, = self._grad((y2 * w).sum(), x2)
                    o = torch.arange(b, device=self.device) != j
                    moved, shifted = rel(y2[o], y[o], magnitude(y)), rel(g2[o], g[o], magnitude(g))
                    worst = max(worst, moved, shifted)
                    if max(moved, shifted) > EXACT[dtype] or not torch.isfinite(g2).all():
                        what = "outputs" if moved > EXACT[dtype] else "input gradients"
                        return Check("batch independence", "fail",
                                     f"replacing sequence {j} moved the other sequences' {what} by "
                                     f"{max(moved, shifted):.1e} of their scale ({form_name(causal)}, {where}; "
                                     f"allowed {EXACT[dtype]:.0e}): the batch's sequences mix")
        return Check("batch independence", "pass", f"each of {b} sequences replaced in turn, eval and train mode: "
                                                   f"the others' outputs and input gradients moved at most "
                                                   f"{worst:.1e} (allowed {tolerances(EXACT)})")
