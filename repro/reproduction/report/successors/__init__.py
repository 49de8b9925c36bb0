"""Beyond the paper: linear attention's successors (retention, gated linear attention, the delta
rule) on the paper's tasks beside softmax and linear: the copy task against N with the section's
one judged question (does each successor copy better than linear where linear's additive memory
runs out?), MNIST bits/dim, generation speed and speech recognition, as measurements.

Its folders are those results/claims.yaml names under report.successors (copy, softmax_128, mnist,
speed, speech); the paper's sections name theirs, so a successors run is never one more run of
Figure 2, Tables 1-5 or Table 3."""
from repro.reproduction.report.successors.copy_task import copy_lengths
from repro.reproduction.report.successors.generation import mnist, speed
from repro.reproduction.report.successors.speech import speech

__all__ = ["successors"]

INTRO = (
    "The paper's linear attention updates its memory additively, S_i = S_{i-1} + phi(k_i) v_i^T. Its successors "
    "change only that update: retention decays it by a fixed gamma per head, gated linear attention by a learned "
    "decay per key dimension, and the delta rule writes over what a key held (docs/attention.md). Here they run the "
    "paper's tasks at CPU sizes beside softmax and linear; these runs appear in no table of the paper above. One "
    "question is judged over the seeds by the rules of the claims above (a gap inside the spread is a tie): on the "
    "copy task, at each N where linear's held-out loss stays above softmax's by more than the spread (its 16 x 16 "
    "state per head has run out of capacity), does each successor reach a lower held-out loss than linear? At an N "
    "where linear matches softmax the question is not asked. Everything else is a measurement. (loaded): the "
    "machine's 1-minute load average passed its cores while the run ran, so its wall-clock value is inflated. "
    "Their time and memory against N are in Figure 1's runs and the kernel and CPU-speed sections.")


def successors(ctx) -> str:
    parts = [copy_lengths(ctx), mnist(ctx), speed(ctx), speech(ctx)]
    return "\n\n".join(["## Beyond the paper: linear attention's successors", INTRO, *parts])


SECTIONS = [(70, "successors", successors)]
