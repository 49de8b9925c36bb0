"""English sentences that exist on every machine with Python: the prose of Python's own
documentation shipped with the interpreter (pydoc_data.topics: the language reference's
sections) and, when more are asked for, the docstrings of the standard library's modules,
classes and functions (read with ast, never imported). Kept: plain sentences of words only
(letters, an apostrophe, commas), min_words..max_words long, no CamelCase or code names."""
import ast
import re
import sysconfig
from pathlib import Path

PLAIN = re.compile(r"[A-Z][a-z]*(?:,? [a-z]+(?:'[a-z]+)?)*[.]")
SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "tkinter", "turtledemo"}


def _sentences(texts, min_words, max_words):
    flat = re.sub(r"\s+", " ", " ".join(texts))
    found = {s for s in re.split(r"(?<=[.!?])\s+", flat)
             if PLAIN.fullmatch(s) and min_words <= len(s.split()) <= max_words}
    return sorted(found)


def _docstrings():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def english_sentences(n: int, min_words: int = 4, max_words: int = 20) -> list[str]:
    """At least n sentences when the sources hold them (sorted, deduplicated), else all there are."""
    import pydoc_data.topics

    out = _sentences(pydoc_data.topics.topics.values(), min_words, max_words)
    if len(out) < n:
        out = sorted(set(out) | set(_sentences(_docstrings(), min_words, max_words)))
    return out
