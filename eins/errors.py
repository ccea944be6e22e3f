"""Errors raised by eins. Every message names the offending value; trace-time errors also
name the user's file and line (see :func:`eins.tracing.user_frame`)."""


class EinsError(Exception):
    """Base class of every error eins raises on purpose."""


class ShapeError(EinsError, ValueError):
    """Operand shapes do not fit the operator."""


class DTypeError(EinsError, TypeError):
    """An unsupported dtype, or dtypes that do not fit the operator."""


class IndexRangeError(EinsError, IndexError):
    """An integer index outside its axis (a gather's or scatter's indices, an ``x[i]``),
    found at trace time for constants, at run time on the numpy backend (numpy's rule)."""


class TraceError(EinsError, TypeError):
    """A traced function was called or written in a way eins cannot trace."""


class TraceAttributeError(TraceError, AttributeError):
    """A numpy or torch attribute a traced array does not have (``x.item()``, ``x.permute``):
    an AttributeError too, so ``hasattr`` and ``getattr(x, name, default)`` work."""


class UnsupportedOpError(TraceError, NotImplementedError):
    """A torch module uses an ATen op eins has no mapping for (eins.from_torch): the message
    names the op, the submodule and source line it came from, and the supported ops."""


class ExportError(TraceError):
    """``torch.export`` refused a module (data-dependent control flow, an unsupported Python
    construct); the exporter's own exception is attached as ``__cause__``."""


class EinsumError(EinsError, ValueError):
    """A malformed einsum subscript string."""


class PlanError(EinsError, ValueError):
    """The logical optimizer cannot plan the program as asked."""


class ExProgError(EinsError, ValueError):
    """A malformed or invalid exchange program."""


class ExProgSyntaxError(ExProgError):
    """ExProg text that does not parse; carries line and column."""

    def __init__(self, message, line, col):
        super().__init__(f"line {line}, column {col}: {message}")
        self.line = line
        self.col = col


class TopologyError(EinsError, ValueError):
    """An unknown preset, a malformed topology file or `nvidia-smi topo -m` text."""


class LoweringError(EinsError, RuntimeError):
    """A stage's invariant does not hold (found by eins.passes.verify)."""


class GpuError(EinsError, RuntimeError):
    """The GPU runtime cannot run as asked: a missing package (the message names the pip
    extra to install), no visible GPU, a bad device map, or an input on the wrong device."""


class StreamError(GpuError):
    """Work issued outside the stream that owns it, or a wait on an event never recorded
    (the stream discipline of eins/runtime/gpu.py)."""


class OutputError(EinsError, OSError):
    """A file or directory eins was asked to write (generated code, traces) cannot be
    written: the path is a file, or not writable."""


class InputError(EinsError, ValueError):
    """A file eins was asked to read is not text it can decode (binary, not UTF-8)."""


class DistributedError(EinsError, RuntimeError):
    """The rank runtime (devices="world") cannot join, agree or communicate: a rank that
    exited or never sent, ranks whose plans differ, a wait past ``timeout_s``."""


class PromotionWarning(UserWarning):
    """An operator made float64 from float32 (or narrower) arrays because of a 64-bit scalar
    (numpy 2's rule for a numpy float64 such as ``np.sqrt(hd)``): twice the memory and
    time, seldom meant."""
