"""A step counter with time left, on stderr: one line rewritten on a
terminal (``[####....] 12/40  1m05s left  what``), one line per step
otherwise (logs, CI)."""

import sys
import time


def _dur(s):
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, total, out=None):
        self.out = out or sys.stderr
        self.total, self.done = max(total, 1), 0
        self.enabled = getattr(self.out, "isatty", lambda: False)()
        self.t0 = time.time()

    def left(self):
        """Time left, from the mean time per step so far ("?" before the first)."""
        if not self.done:
            return "?"
        return _dur((time.time() - self.t0) / self.done * (self.total - self.done))

    def step(self, what, done=None):
        """One more step done (or ``done`` in all), described by ``what``."""
        self.done = min(self.done + 1 if done is None else done, self.total)
        elapsed = _dur(time.time() - self.t0)
        if not self.enabled:
            print(f"[{self.done}/{self.total}] {elapsed} elapsed, {self.left()} left: {what}",
                  file=self.out, flush=True)
            return
        n = 30 * self.done // self.total
        line = f"\r[{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {self.left():>6} left  {what}"
        print(f"{line[:110]:<110}", end="", file=self.out, flush=True)

    def close(self):
        if self.enabled:
            print(file=self.out, flush=True)
