"""Machine profiles: what one GPU model sustains per kernel class, as fractions of its data
sheet (docs/costs.md, "Calibration").

The kernel model (:func:`eins.cost.predict.kernel_seconds`) charges a kernel of ``W`` FLOPs
and ``B`` HBM bytes ``max((W + W_HALF) / (F e_f(W)), (B + B_HALF) / (BW e_b(B))) +
overhead``, where ``F`` and ``BW`` are the data sheet's dense 16-bit rate and HBM bandwidth,
and ``e_f``, ``e_b`` and ``overhead`` come from the :class:`ClassProfile` of the
primitive's kernel class (``Primitive.kernel_class``). Without a profile every efficiency
is 1 and the overhead 0: the data sheet's roofline, eins's model before calibration.

An efficiency is a curve over the kernel's size (FLOPs for ``e_f``, bytes for ``e_b``):
points ``(size, efficiency)``, linear in log(size) between them and flat beyond the first
and the last, so a class measured at several shapes (matmul by shape, attention by length)
is priced by the nearest ones. ``folded`` classes cost nothing: the GPU runtime folds them
into their neighbours' launches (layout changes read as strided views).

Profiles are JSON files (:meth:`Profile.from_json`, :meth:`Profile.to_dict`); ``eins
calibrate`` writes them from measurements (eins/cost/calibrate.py). Unknown keys are
errors, so a typo does not pass silently.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType

from eins.errors import TopologyError
from eins.hardware.checks import positive, short
from eins.hardware.specs import US_PER_S

# The kernel classes of eins's primitives (``Primitive.kernel_class``): a profile may price
# each; a class it does not name takes its ``default``.
KERNEL_CLASSES = ("matmul", "attention", "elementwise", "norm", "rope", "reduction", "view",
                  "copy", "gather", "sort")

_CLASS_KEYS = {"flops", "hbm", "overhead_us", "folded", "note"}
_KEYS = {"name", "gpu", "calibrated", "source", "classes", "default", "copy", "shared",
         "attention"}


def _curve(points, x: float) -> float:
    """The efficiency at size ``x`` of ``points`` ((size, efficiency), sizes increasing):
    linear in log(size) between points, flat outside them; 1.0 without points."""
    if not points:
        return 1.0
    if x <= points[0][0]:
        return points[0][1]
    for (x0, e0), (x1, e1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return e0 + t * (e1 - e0)
    return points[-1][1]


def _points(name, label, v) -> tuple:
    """A curve from JSON: a list of [size, efficiency] pairs, sizes positive and strictly
    increasing, efficiencies in (0, 1]."""
    if not isinstance(v, (list, tuple)):
        raise TopologyError(f"profile {name!r}: {label} must be a list of [size, efficiency] "
                            f"pairs, got {short(v)}")
    out = []
    for p in v:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise TopologyError(f"profile {name!r}: {label} has {short(p)}, not a "
                                f"[size, efficiency] pair")
        size = positive(name, f"a size of {label}", p[0])
        eff = positive(name, f"an efficiency of {label}", p[1])
        if eff > 1:
            raise TopologyError(f"profile {name!r}: {label} has efficiency {short(p[1])} "
                                f"above 1 (a fraction of the data sheet's peak)")
        if out and size <= out[-1][0]:
            raise TopologyError(f"profile {name!r}: {label}'s sizes must increase, got "
                                f"{short(p[0])} after {short(out[-1][0])}")
        out.append((size, eff))
    return tuple(out)


@dataclass(frozen=True)
class ClassProfile:
    """One kernel class on one GPU model: ``flops`` and ``hbm``, efficiency curves
    ((size, fraction of peak), ...; empty: 1.0); ``overhead_s``, seconds added per kernel;
    ``folded``: the runtime folds it into its neighbours, so it costs nothing; ``note``:
    where the numbers come from."""

    flops: tuple = ()
    hbm: tuple = ()
    overhead_s: float = 0.0
    folded: bool = False
    note: str = ""

    def flops_eff(self, work: float) -> float:
        return _curve(self.flops, work)

    def hbm_eff(self, nbytes: float) -> float:
        return _curve(self.hbm, nbytes)

    @property
    def peaks(self) -> tuple:
        """(the highest ``flops`` efficiency, the highest ``hbm`` one) at any size: no
        kernel of the class runs faster (a lower bound's rates, eins.cost.predict
        .pieces_floor)."""
        return (max((e for _, e in self.flops), default=1.0),
                max((e for _, e in self.hbm), default=1.0))

    def to_dict(self) -> dict:
        out = {}
        if self.flops:
            out["flops"] = [list(p) for p in self.flops]
        if self.hbm:
            out["hbm"] = [list(p) for p in self.hbm]
        if self.overhead_s:
            out["overhead_us"] = self.overhead_s * US_PER_S
        if self.folded:
            out["folded"] = True
        if self.note:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, name, label, d) -> "ClassProfile":
        if not isinstance(d, dict):
            raise TopologyError(f"profile {name!r}: {label} must be an object, got {short(d)}")
        unknown = set(d) - _CLASS_KEYS
        if unknown:
            raise TopologyError(f"profile {name!r}: {label} has unknown keys "
                                f"{sorted(unknown)}; known: {sorted(_CLASS_KEYS)}")
        folded = d.get("folded", False)
        if not isinstance(folded, bool):
            raise TopologyError(f"profile {name!r}: {label}.folded must be true or false, "
                                f"got {short(folded)}")
        note = d.get("note", "")
        if not isinstance(note, str):
            raise TopologyError(f"profile {name!r}: {label}.note must be a string")
        over = positive(name, f"{label}.overhead_us", d.get("overhead_us", 0), zero=True)
        return cls(flops=_points(name, f"{label}.flops", d.get("flops", [])),
                   hbm=_points(name, f"{label}.hbm", d.get("hbm", [])),
                   overhead_s=over / US_PER_S, folded=folded, note=note)


@dataclass(frozen=True, eq=False)   # hashable by identity (its tables are mappings)
class Profile:
    """What one GPU model sustains (module docstring). ``classes``: {kernel class:
    :class:`ClassProfile`}; ``default``: the classes it does not name; ``copy_hbm`` and
    ``copy_overhead_s``: local device-to-device copies (two logical devices on one GPU),
    as a fraction of the HBM bandwidth (a copy reads and writes each byte) and seconds per
    copy; ``shared_overhead_s``: seconds each kernel of a logical device costs beyond its
    own time where several logical devices share the GPU (their streams' waits and
    smaller kernels), with ``shared_note`` saying how it was found; ``attention``: measured
    attention kernels, {"impl": {"float16 S=...": ms}} rows that ``attention="auto"``
    reads; ``calibrated``: measured on the GPU (False: published figures or none);
    ``source``: where from."""

    name: str
    gpu_model: str = ""
    calibrated: bool = False
    source: str = ""
    classes: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    default: ClassProfile = ClassProfile()
    copy_hbm: float = 1.0
    copy_overhead_s: float = 0.0
    shared_overhead_s: float = 0.0
    shared_note: str = ""
    attention: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def entry(self, kernel_class) -> ClassProfile:
        """The :class:`ClassProfile` pricing ``kernel_class``."""
        return self.classes.get(kernel_class, self.default)

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"name": self.name, "gpu": self.gpu_model, "calibrated": self.calibrated,
               "source": self.source,
               "classes": {k: v.to_dict() for k, v in self.classes.items()},
               "default": self.default.to_dict()}
        copy = {}
        if self.copy_hbm != 1.0:
            copy["hbm"] = self.copy_hbm
        if self.copy_overhead_s:
            copy["overhead_us"] = self.copy_overhead_s * US_PER_S
        if copy:
            out["copy"] = copy
        if self.shared_overhead_s:
            out["shared"] = {"overhead_us": self.shared_overhead_s * US_PER_S,
                             "note": self.shared_note}
        if self.attention:
            out["attention"] = {k: dict(v) for k, v in self.attention.items()}
        return out

    @classmethod
    def from_dict(cls, d, name="profile") -> "Profile":
        if not isinstance(d, dict):
            raise TopologyError(f"profile {name!r} must be a JSON object, got {short(d)}")
        name = d.get("name", name)
        unknown = set(d) - _KEYS
        if unknown:
            raise TopologyError(f"profile {name!r} has unknown keys {sorted(unknown)}; "
                                f"known: {sorted(_KEYS)}")
        classes = d.get("classes", {})
        if not isinstance(classes, dict):
            raise TopologyError(f"profile {name!r}: classes must be an object")
        for k in classes:
            if k not in KERNEL_CLASSES:
                raise TopologyError(f"profile {name!r}: unknown kernel class {k!r}; classes "
                                    f"are {', '.join(KERNEL_CLASSES)}")
        copy = d.get("copy", {})
        if not isinstance(copy, dict) or set(copy) - {"hbm", "overhead_us"}:
            raise TopologyError(f"profile {name!r}: copy must be an object with 'hbm' and "
                                f"'overhead_us', got {short(copy)}")
        copy_hbm = positive(name, "copy.hbm", copy.get("hbm", 1.0))
        if copy_hbm > 1:
            raise TopologyError(f"profile {name!r}: copy.hbm {short(copy_hbm)} is above 1")
        attention = d.get("attention", {})
        if not isinstance(attention, dict) or not all(
                isinstance(v, dict) and all(isinstance(t, (int, float)) and t > 0
                                            for t in v.values())
                for v in attention.values()):
            raise TopologyError(f"profile {name!r}: attention must map a kernel to "
                                f"{{shape: milliseconds}}, got {short(attention)}")
        shared = d.get("shared", {})
        if not isinstance(shared, dict) or set(shared) - {"overhead_us", "note"}:
            raise TopologyError(f"profile {name!r}: shared must be an object with "
                                f"'overhead_us' and 'note', got {short(shared)}")
        calibrated = d.get("calibrated", False)
        if not isinstance(calibrated, bool):
            raise TopologyError(f"profile {name!r}: calibrated must be true or false")
        return cls(name=str(name), gpu_model=str(d.get("gpu", "")), calibrated=calibrated,
                   source=str(d.get("source", "")),
                   classes=MappingProxyType({k: ClassProfile.from_dict(name, f"classes.{k}", v)
                                             for k, v in classes.items()}),
                   default=ClassProfile.from_dict(name, "default", d.get("default", {})),
                   copy_hbm=copy_hbm,
                   copy_overhead_s=positive(name, "copy.overhead_us",
                                            copy.get("overhead_us", 0), zero=True) / US_PER_S,
                   shared_overhead_s=positive(name, "shared.overhead_us",
                                              shared.get("overhead_us", 0), zero=True) / US_PER_S,
                   shared_note=str(shared.get("note", "")),
                   attention=MappingProxyType({k: MappingProxyType(dict(v))
                                               for k, v in attention.items()}))

    @classmethod
    def from_json(cls, path) -> "Profile":
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise TopologyError(f"cannot read profile {str(path)!r}: "
                                f"{e.strerror or e}") from None
        except ValueError as e:
            raise TopologyError(f"profile {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(d, name=str(path))

    def to_json(self, path=None) -> str:
        """The JSON text (curve points one per line), written to ``path`` when given."""
        text = re.sub(r"\[\s+(\S+),\s+(\S+)\s+\]", r"[\1, \2]",
                      json.dumps(self.to_dict(), indent=1)) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


# The profiles eins ships (this package's profiles/ folder), by name: "h200" (measured),
# "h100-published" and "a100-published" (published kernel figures, sources in each file).
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
_SHIPPED: dict = {}


def shipped_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(profile) -> Profile | None:
    """A Profile from a Profile, a shipped profile's name (:func:`shipped_profiles`), a JSON
    file path, or None (no profile)."""
    if profile is None or isinstance(profile, Profile):
        return profile
    if isinstance(profile, str) and not profile.endswith(".json"):
        if profile not in shipped_profiles():
            raise TopologyError(f"unknown profile {profile!r}: a JSON file, or one of "
                                f"{', '.join(shipped_profiles())}")
        if profile not in _SHIPPED:
            _SHIPPED[profile] = Profile.from_json(os.path.join(PROFILE_DIR, profile + ".json"))
        return _SHIPPED[profile]
    if isinstance(profile, str) or hasattr(profile, "__fspath__"):
        return Profile.from_json(profile)
    raise TopologyError(f"profile must be a JSON file path or an eins Profile, got "
                        f"{type(profile).__name__} {short(profile)}")
