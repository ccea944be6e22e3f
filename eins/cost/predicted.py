"""What ``Lowered.predicted_time()`` returns: the dict of :func:`eins.cost.predict.predict`
(``t["compute_ms"]``, ``json.dumps(t)`` and ``dict(t)`` work as before) that prints as a
short table instead of 2.8 KB of 17-digit floats."""
from __future__ import annotations

from eins.ir.text import format_bytes

__all__ = ["PredictedTime"]


class PredictedTime(dict):
    """The keys of :func:`eins.cost.predict.predict`; ``str()`` and ``repr()`` are the
    table (compute, exchanges, total, peak memory per device). Every figure is in the
    dict: the table only rounds them."""

    def _timeline(self) -> str:
        """The total's note: the GPU-by-GPU time where it is below the eqn-by-eqn sum."""
        total, line = self.get("total_ms"), self.get("timeline_ms")
        if total is None or line is None or line >= total * (1 - 1e-6):
            return ""
        return f"  GPU by GPU {line:.3f} ms"

    def table(self) -> str:
        fits = self.get("fits")
        head = f"predicted on {self.get('topology')}"
        if fits is not None:
            head += " (fits in memory)" if fits else " (does NOT fit in memory)"
        rows = [("compute", self.get("compute_ms", 0.0), ""),
                ("exchanges", self.get("exchange_ms", 0.0),
                 f"  output gathers {self.get('gather_ms', 0.0):.3f} ms"
                 if self.get("gather_ms") else ""),
                ("total", self.get("total_ms", 0.0), self._timeline())]
        per = self.get("per_eqn") or []
        if any(r.get("phase") == "bwd" for r in per):   # a training step: its two passes
            for phase, name in (("fwd", "forward"), ("bwd", "backward")):
                ms = sum(r["compute_ms"] + r["exchange_ms"] + r["gather_ms"] for r in per
                         if r.get("phase") == phase)
                rows.insert(len(rows) - 1, (name, ms, ""))
        lines = [head] + [f"  {name:<10}{ms:>11.3f} ms{note}" for name, ms, note in rows]
        peaks = self.get("peak_bytes") or {}
        if peaks:
            lines.append("  peak memory per device: " + _grouped(peaks))
        placed = self.get("placed_peak_bytes") or {}
        if placed and placed != peaks:
            lines.append("  with the inputs held on the devices: " + _grouped(placed)
                         + ("" if self.get("fits_placed", True) else " (does NOT fit)"))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self):
        return self.table()


def _grouped(peaks: dict) -> str:
    """``1.54 GiB on 0-7`` / ``1.2 GiB on 0,2; 800 MiB on 1,3``: devices of equal peaks
    together, largest first."""
    by: dict = {}
    for d, b in peaks.items():
        by.setdefault(b, []).append(d)
    parts = []
    for b in sorted(by, reverse=True):
        parts.append(f"{format_bytes(b)} on {_ranges(sorted(by[b]))}")
    return "; ".join(parts)


def _ranges(ds) -> str:
    out, start = [], None
    for k, d in enumerate(ds):
        if start is None:
            start = d
        if k + 1 == len(ds) or ds[k + 1] != d + 1:
            out.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(out)
