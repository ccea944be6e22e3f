"""Progress of the slow steps (tracing, planning, synthesis, lowering, codegen, Triton
compilation): each is a :func:`step`, which logs through :mod:`logging` (logger ``"eins"``:
the step's start at DEBUG, its time at INFO) and, on a terminal, draws a one-line bar on
stderr once it has taken more than about a second (eins's own; no dependency).

``verbose=`` on :func:`eins.distribute` and the CLI, or ``EINS_VERBOSE``, set the level
(:func:`set_verbose`): 0 / False / "warning" (the default: warnings only), 1 / True /
"info" (each step's time), 2 / "debug" (every step's start too). ``EINS_PROGRESS=0`` turns
the bar off; it is drawn only when stderr is a terminal.

>>> with step("planning", total=3, unit="trees") as s:
...     for _ in range(3):
...         s.update()
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

from eins.errors import EinsError

__all__ = ["LOG", "step", "tick", "set_verbose", "verbose_level"]

LOG = logging.getLogger("eins")

# a step's bar appears after this many seconds (a quick step draws nothing)
BAR_AFTER_S = 1.0
_REDRAW_S = 0.2

_LEVELS = {"0": logging.WARNING, "false": logging.WARNING, "warning": logging.WARNING,
           "1": logging.INFO, "true": logging.INFO, "info": logging.INFO,
           "2": logging.DEBUG, "debug": logging.DEBUG}
_HANDLER: list = []   # the stderr handler set_verbose adds to LOG (once)
_QUIET = False        # set_verbose(0): no bar


def verbose_level(verbose) -> int:
    """``verbose`` (a bool, 0-2, or a level's name) as a logging level; an EinsError
    naming anything else."""
    if isinstance(verbose, bool) or isinstance(verbose, int):
        key = str(int(verbose))
    elif isinstance(verbose, str):
        key = verbose.strip().lower()
    else:
        key = None
    if key not in _LEVELS:
        raise EinsError(f"verbose must be 0, 1, 2 (or False, True, 'warning', 'info', "
                        f"'debug'), got {verbose!r}")
    return _LEVELS[key]


def set_verbose(verbose) -> None:
    """Set the ``eins`` logger's level from ``verbose`` (see :func:`verbose_level`) and,
    unless the application configured logging for it, print its records on stderr.
    ``None``: back to the defaults (the level logging's configuration gives, the bar on)."""
    global _QUIET
    if verbose is None:
        _QUIET = False
        LOG.setLevel(logging.NOTSET)
        return
    level = verbose_level(verbose)
    _QUIET = level > logging.INFO   # verbose=0: no bar either
    LOG.setLevel(level)
    if not _HANDLER and not LOG.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("eins: %(message)s"))
        LOG.addHandler(h)
        _HANDLER.append(h)


def _from_env() -> None:
    v = os.environ.get("EINS_VERBOSE")
    if v:
        try:
            set_verbose(v)
        except EinsError as e:   # a bad variable must not stop `import eins`
            LOG.warning("EINS_VERBOSE=%r ignored: %s", v, e)


class _Bar(threading.Thread):
    """Redraws the innermost running step's line on stderr every ``_REDRAW_S`` seconds,
    from ``BAR_AFTER_S`` into it."""

    def __init__(self):
        super().__init__(daemon=True, name="eins-progress")
        self.stop = threading.Event()
        self.drawn = False

    def run(self):
        while not self.stop.wait(_REDRAW_S):
            top = _STACK[-1] if _STACK else None
            if top is not None and time.perf_counter() - top.t0 >= BAR_AFTER_S:
                line = " > ".join(s.text() for s in list(_STACK))
                sys.stderr.write(f"\r\033[Keins: {line}")
                sys.stderr.flush()
                self.drawn = True

    def close(self):
        self.stop.set()
        self.join()
        if self.drawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


_STACK: list = []   # the steps running now (nested), outermost first
_BAR: list = []


def _bar_wanted() -> bool:
    return not _QUIET and os.environ.get("EINS_PROGRESS", "1") != "0" and _isatty()


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # closed or replaced stderr
        return False


class step:
    """``with step("synthesis", total=n, unit="exchanges") as s: ... s.update()``: one slow
    step, logged (DEBUG at its start, INFO with its time) and drawn as a bar on a terminal
    when it runs past about a second. Steps nest (a pass inside planning)."""

    def __init__(self, what: str, total: int | None = None, unit: str = ""):
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.t0 = 0.0

    def __enter__(self):
        self.t0 = time.perf_counter()
        LOG.debug("%s ...", self.what)
        # the bar follows the main thread's steps (a worker's steps are logged only)
        if threading.current_thread() is threading.main_thread():
            if not _STACK and _bar_wanted():
                bar = _Bar()
                _BAR.append(bar)
                bar.start()
            _STACK.append(self)
        return self

    def update(self, n: int = 1) -> None:
        self.done += n

    def text(self) -> str:
        count = (f" {self.done}/{self.total} {self.unit}".rstrip() if self.total is not None
                 else f" {self.done} {self.unit}".rstrip() if self.done else "")
        return f"{self.what}{count} {time.perf_counter() - self.t0:.1f} s"

    def __exit__(self, *exc):
        if _STACK and _STACK[-1] is self:
            _STACK.pop()
        if not _STACK and _BAR:
            _BAR.pop().close()
        dt = time.perf_counter() - self.t0
        count = f", {self.done} {self.unit}".rstrip() if self.unit and self.done else ""
        LOG.info("%s: %.2f s%s", self.what, dt, count)
        return False


_from_env()


def tick(n: int = 1) -> None:
    """One more unit of the innermost running step (a loop's hook: one line)."""
    if _STACK and threading.current_thread() is threading.main_thread():
        _STACK[-1].update(n)
