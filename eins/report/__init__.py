"""Plans that explain themselves: why each eqn got its spec (:mod:`.explain`), the
predicted schedule (:mod:`.schedule`) as a Perfetto / Chrome trace (:mod:`.trace`) and as
one self-contained HTML page (:mod:`.html`). ``Lowered.explain``, ``Lowered.report`` and
``Lowered.trace`` call the three functions here."""
from __future__ import annotations

from eins.report.explain import explain
from eins.report.html import write_report
from eins.report.schedule import predicted_schedule
from eins.report.trace import write_trace

__all__ = ["explain", "report", "trace"]


def report(low, path, compare=None) -> str:
    """Write ``low``'s HTML page to ``path`` (``compare``: {strategy name: Lowered or
    {total_ms, compute_ms, exchange_ms}} drawn side by side); returns the path."""
    return write_report(low, path, compare)


def trace(low, path) -> str:
    """Write ``low``'s predicted schedule to ``path`` as trace-event JSON; returns the
    path."""
    return write_trace(predicted_schedule(low.physical), path, low.program.name)
