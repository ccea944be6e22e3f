"""What to write instead of the numpy functions and ufuncs eins does not trace (the errors
of eins/numpy_api.py name them): the closest traced way to say the same, by name."""
from __future__ import annotations

import difflib

_INDEX_SET = "item assignment: x = x.at[idx].set(v) (or np.where(mask, v, x))"
# the closest traced way to write a numpy function eins does not trace
HINTS = {
    "argpartition": "eins.top_k(x, k) (values and indices of the k largest)",
    "partition": "eins.top_k(x, k) or np.sort(x, axis)",
    "median": "np.sort(x, axis) and index the middle",
    "percentile": "np.sort(x, axis) and index the position",
    "quantile": "np.sort(x, axis) and index the position",
    "nanmax": "np.max(np.where(np.isnan(x), -np.inf, x))",
    "nanmin": "np.min(np.where(np.isnan(x), np.inf, x))",
    "nansum": "np.sum(np.where(np.isnan(x), 0, x))",
    "nanmean": "np.sum(np.where(np.isnan(x), 0, x)) / np.sum(~np.isnan(x))",
    "count_nonzero": "np.sum(x != 0, axis)",
    "ptp": "x.max(axis) - x.min(axis)",
    "average": "np.sum(x * w, axis) / np.sum(w, axis)",
    "diff": "x[..., 1:] - x[..., :-1]",
    "moveaxis": "np.transpose(x, axes)", "rollaxis": "np.transpose(x, axes)",
    "atleast_1d": "x.reshape(shape)", "atleast_2d": "x.reshape(shape)",
    "atleast_3d": "x.reshape(shape)",
    "column_stack": "np.stack(arrays, axis=1)", "dstack": "np.stack(arrays, axis=2)",
    "append": "np.concatenate([x, values])", "insert": "np.concatenate of slices",
    "delete": "np.concatenate of slices",
    "select": "nested np.where(cond, a, np.where(...))",
    "piecewise": "nested np.where(cond, f(x), ...)",
    "diag": "x * np.eye(n) (or np.einsum('ii->i', x) outside the trace)",
    "diagonal": "np.sum(x * np.eye(n), -1)", "trace": "np.sum(x * np.eye(n))",
    "inner": "np.einsum('...i,...i->...', a, b)", "tensordot": "np.einsum",
    "kron": "np.einsum and a reshape", "meshgrid": "broadcasting: x[:, None], y[None, :]",
    "isclose": "np.abs(a - b) <= atol + rtol * np.abs(b)",
    "allclose": "np.all(np.abs(a - b) <= atol + rtol * np.abs(b)), returned",
    "array_equal": "np.all(a == b), returned (a Python bool needs concrete values)",
    "searchsorted": "np.sum(x[..., None] >= edges, -1)",
    "digitize": "np.sum(x[..., None] >= bins, -1)",
    "bincount": "one-hot counts: np.sum(ids[..., None] == np.arange(n), 0)",
    "histogram": "one-hot counts of np.sum(x[..., None] >= edges, -1)",
    "interp": "np.where over the segments, or a gather of a table",
    "put": _INDEX_SET, "place": _INDEX_SET, "putmask": _INDEX_SET, "copyto": _INDEX_SET,
    "fill_diagonal": "np.where(np.eye(n, dtype=bool), v, x)",
    "linalg.inv": "no decomposition traces; solve outside the traced function",
    "linalg.solve": "no decomposition traces; solve outside the traced function",
    "linalg.svd": "no decomposition traces", "linalg.qr": "no decomposition traces",
    "linalg.eigh": "no decomposition traces", "linalg.det": "no decomposition traces",
    "linalg.cholesky": "no decomposition traces",
    "linalg.matrix_norm": "np.linalg.norm(x, axis=(-2, -1))",
    "linalg.vector_norm": "np.linalg.norm(x, axis=-1)",
}

# ufuncs eins has no primitive for, and their reductions and scans
UFUNC_HINTS = {
    "matvec": "x @ v", "vecmat": "v @ x", "vecdot": "np.einsum('...i,...i->...', a, b)",
}
REDUCE_HINTS = {("add", "reduce"): "np.sum", ("multiply", "reduce"): "np.prod",
                 ("maximum", "reduce"): "np.max", ("minimum", "reduce"): "np.min",
                 ("fmax", "reduce"): "np.max", ("fmin", "reduce"): "np.min",
                 ("logical_or", "reduce"): "np.any", ("logical_and", "reduce"): "np.all",
                 ("bitwise_or", "reduce"): "np.any", ("bitwise_and", "reduce"): "np.all",
                 ("add", "accumulate"): "np.cumsum", ("multiply", "accumulate"): "np.cumprod",
                 ("logaddexp", "reduce"): "m + np.log(np.sum(np.exp(x - m))), m = x.max()"}


def closest(name, names) -> str:
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f"the closest traced: {', '.join('np.' + n for n in near)}; " if near else ""


def write(hint: str) -> str:
    """A hint as the error says it: what to write, or that nothing traces."""
    return hint if hint.startswith("no ") else f"write {hint}"
