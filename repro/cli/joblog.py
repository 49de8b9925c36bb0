"""What a job prints (the tasks print rather than log) also goes to the log file Hydra opens in
its run dir, <run dir>/run.log, line by line."""
import logging
import sys
from contextlib import contextmanager


class _Tee:
    """A text stream that also hands each complete line to logging handlers (the job's log file)."""

    def __init__(self, stream, name: str, level: int, handlers):
        self.stream, self.name, self.level, self.handlers, self.pending = stream, name, level, handlers, ""

    def write(self, text):
        n = self.stream.write(text)
        # A progress bar rewrites one line with \r for a whole run: keep only its last state, so
        # each write costs its own length, not the bar's history.
        *lines, tail = (self.pending + text).split("\n")
        self.pending = tail.rsplit("\r", 1)[-1]
        for line in lines:
            line = line.rsplit("\r", 1)[-1]  # a progress bar's line: its last state
            if line.strip():
                record = logging.LogRecord(self.name, self.level, __file__, 0, line, None, None)
                for handler in self.handlers:
                    handler.handle(record)
        return n

    def __getattr__(self, name):  # flush, isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def tee_to_job_log():
    """While a job runs, what it prints (stdout, and stderr) also goes to the log file Hydra
    opens in its run dir (<run dir>/run.log), as log lines: the tasks print rather than log."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not handlers:
        yield
        return
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, "stdout", logging.INFO, handlers), _Tee(err, "stderr", logging.INFO, handlers)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
