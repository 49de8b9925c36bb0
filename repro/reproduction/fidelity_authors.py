"""Runs one of the authors' scripts (idiap/linear-transformer-experiments) under their own
Python, with what repro.reproduction.fidelity needs and nothing of theirs changed on disk:

    AUTHORS_PYTHON fidelity_authors.py --task copy|mnist --script DIR/main.py --seed S -- THEIR ARGS

Standalone on purpose (torch and the standard library only): it runs in the authors' virtual
environment, which has their library and none of ours. What it does to their script, at run time:
- one torch thread and torch.manual_seed(S) before their main() (their scripts seed nothing);
- copy: their held-out loss also scores the separator's target (position n - 1); ours scores the
  copy only. The separator is an easy target (no other first-half position is scored, so a
  model may predict it at every one), so their mean is the copy's diluted by one near-free
  target of n + 1. Their evaluate() is wrapped to print, after their own "Testing =>" line, the
  copy-only loss on the same batches: "Copy only => Loss: L Accuracy: A". Their training is
  untouched.
Then it prints "authors: versions {json}" for the driver's rows. Nothing else needs changing on
today's torch (2.14): their image-generation/radam.py's Tensor.add_(scalar, tensor) overloads
still run, with a deprecation warning.
"""
import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch


def _copy_only(ns):
    """Wraps their loss() and evaluate() (ns: their main module's globals) to add the copy-only
    held-out loss: their mask with its first position (the separator's) left out."""
    their_loss, their_evaluate = ns["loss"], ns["evaluate"]
    sums = {"loss": 0.0, "accuracy": 0.0, "samples": 0}

    def loss(y, y_hat, loss_mask):
        out = their_loss(y, y_hat, loss_mask)
        if not torch.is_grad_enabled():  # their evaluate() runs under no_grad, their train() does not
            m = loss_mask.clone()                                           # (L, B) as theirs
            m[m.argmax(0), torch.arange(m.shape[1])] = 0                    # the separator's target
            logits = y_hat.transpose(1, 0)                                  # (L, B, C)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                   reduction="none").view_as(m)
            right = (logits.argmax(-1) == y).float()
            b = y.shape[1]
            sums["loss"] += b * float((ce * m).sum() / m.sum())
            sums["accuracy"] += b * float((right * m).sum() / m.sum())
            sums["samples"] += b
        return out

    def evaluate(*args, **kwargs):
        sums.update(loss=0.0, accuracy=0.0, samples=0)
        result = their_evaluate(*args, **kwargs)
        n = max(sums["samples"], 1)
        print("Copy only => Loss:", sums["loss"] / n, "Accuracy:", sums["accuracy"] / n, flush=True)
        return result

    ns["loss"], ns["evaluate"] = loss, evaluate


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import fast_transformers
        out["fast_transformers"] = getattr(fast_transformers, "__version__", "unknown")
    except ImportError:
        out["fast_transformers"] = "not installed"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("copy", "mnist"), required=True)
    ap.add_argument("--script", required=True, help="their main.py")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then their script's own arguments")
    a = ap.parse_args(argv)
    script = Path(a.script).resolve()
    their_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    print("authors: versions " + json.dumps(versions()), flush=True)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    sys.path.insert(0, str(script.parent))  # their `from utils import ...`, as `python main.py` would
    spec = importlib.util.spec_from_file_location("authors_main", script)  # not __main__: defines their
    module = importlib.util.module_from_spec(spec)                         # main() without calling it
    sys.modules["authors_main"] = module
    spec.loader.exec_module(module)
    if a.task == "copy":
        _copy_only(vars(module))
    sys.argv = [str(script)] + their_args
    module.main(their_args)


if __name__ == "__main__":
    main()
