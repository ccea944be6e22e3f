"""What the device checks (gpu_check.py, gpu_kernels.py) share so that one short lease on a
GPU machine always leaves results behind: a time budget per section, a watchdog per case,
JSON written after every row, and a readable table.

- :class:`Results`: the JSON document (an object with "rows", or ``as_list``: the list of
  rows itself), rewritten atomically after each row (a run killed at
  any point leaves valid JSON with every finished row), with ``running`` naming the case in
  progress and ``finished`` set only at the end. ``resume=True`` reloads it: finished cases
  are skipped and a case that was running when the process died is recorded as failed
  ("killed"), so a rerun picks up after a hang instead of hanging again.
- :class:`Budget`: seconds left in a section (and, optionally, a cap on the cases it
  starts: the CPU dry run cuts its sections by count, so what it runs and skips does not
  depend on the machine's speed); a case that does not start is listed in a "skipped" row
  with the reason, never silently dropped.
- :func:`watchdog`: a case running past its limit has every thread's stack dumped to stderr
  and the process exits (faulthandler's C-level timer: it fires even while the main thread
  is stuck inside a CUDA call holding the GIL). device_session.sh then reruns with
  ``--resume``.
- :func:`run_one`: one case, isolated: its exception becomes ``error`` and a short
  ``traceback`` (chained exceptions included: a failed CUDA graph capture raises from its
  end, hiding the error that broke it) in the row; on CUDA the device is synchronized at
  the case's end, so an asynchronous kernel fault is charged to the case that caused it,
  and where that leaves the CUDA context unusable (sticky errors: an illegal address, a
  device-side assert) the row says so and the process exits with :data:`CONTEXT_LOST`, so
  that device_session.sh resumes the remaining cases in a fresh process instead of
  failing every one of them.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import time
import traceback

CONTEXT_LOST = 75   # exit status: the CUDA context broke; the session resumes the rest


class Budget:
    """``seconds`` for a section; with ``max_cases``, also at most that many cases started
    (``left()`` is 0 once they have been: :func:`run_cases` calls :meth:`started`)."""

    def __init__(self, seconds: float, max_cases: int | None = None):
        if max_cases is not None and max_cases < 0:
            raise ValueError(f"max_cases must be None or >= 0, got {max_cases!r}")
        self.seconds = float(seconds)
        self.max_cases = max_cases
        self.n_started = 0
        self.t0 = time.perf_counter()

    def _capped(self) -> bool:
        return self.max_cases is not None and self.n_started >= self.max_cases

    def left(self) -> float:
        if self._capped():
            return 0.0
        return self.seconds - (time.perf_counter() - self.t0)

    def started(self) -> None:
        self.n_started += 1

    def reason(self) -> str:
        if self._capped():
            return f"the section's cap of {self.max_cases} case(s) was reached"
        return f"the section's {self.seconds:.0f} s budget ran out"


class Results:
    """A JSON object ``{..., "rows": [...], "running": case or None, "finished": bool}``."""

    def __init__(self, path: str, header: dict, resume: bool = False, as_list: bool = False):
        self.path, self.as_list = path, as_list
        self.doc = dict(header, rows=[], running=None, finished=False)
        if resume and path and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            if as_list:   # the running case, if any, is the last item, marked "running"
                running = old.pop() if old and old[-1].get("running") else None
                old = {"rows": old, "running": running}
            self.doc["rows"] = old.get("rows", [])
            if old.get("running"):
                self.doc["rows"].append(dict(old["running"], ok=False, running=False, error=(
                    "killed: the case ran past its watchdog or the process died")))
        self.write()

    @property
    def rows(self):
        return self.doc["rows"]

    def done(self, case_id: str) -> bool:
        """Finished, failed, or skipped for want of time (a resumed run does not retry it)."""
        return any(r.get("case") == case_id or case_id in r.get("skipped", ())
                   for r in self.rows)

    def start(self, row: dict):
        self.doc["running"] = dict(row, started=time.strftime("%H:%M:%S"))
        self.write()

    def add(self, row: dict):
        self.rows.append(row)
        self.doc["running"] = None
        self.write()

    def finish(self, **extra):
        self.doc.update(extra, running=None, finished=True)
        self.write()

    def write(self):
        if not self.path:
            return
        doc = self.doc
        if self.as_list:   # a plain list of rows (the running case last, marked)
            doc = self.rows + ([dict(doc["running"], running=True)] if doc["running"] else [])
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


@contextlib.contextmanager
def watchdog(seconds: float):
    """Dump every stack and exit the process if the block runs past ``seconds``."""
    if seconds and seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        if seconds and seconds > 0:
            faulthandler.cancel_dump_traceback_later()


def run_cases(results: Results, section: str, cases, budget: Budget, case_timeout: float,
              min_left: float = 0.0):
    """Run ``cases`` [(case_id, describe: dict, thunk -> dict)] in order: each within the
    watchdog, its row (``describe`` + what the thunk returns, or the exception) added at once.
    Cases left when the budget runs out (or with less than ``min_left`` seconds left) are
    recorded in one "skipped" row and printed."""
    skipped = []
    for case_id, describe, thunk in cases:
        if results.done(case_id):
            continue
        if budget.left() <= min_left:
            skipped.append(case_id)
            continue
        row = dict(describe, section=section, case=case_id)
        budget.started()
        results.start(row)
        t = time.perf_counter()
        got, err = run_one(thunk, case_timeout)
        row.update(got or {})
        if err:
            row.update(err, ok=False)
            print(f"  {case_id}: ERROR {row['error']}", flush=True)
        row["seconds"] = round(time.perf_counter() - t, 2)
        results.add(row)
        exit_if_context_lost(err, case_id)
    if skipped:
        results.add({"section": section, "case": f"{section}:skipped", "skipped": skipped,
                     "reason": budget.reason()})
        print(f"  NOTE: {section}: {len(skipped)} case(s) skipped ({budget.reason()}): "
              f"{', '.join(skipped)}", flush=True)
    return skipped


def error_fields(e: BaseException, limit: int = 1500) -> dict:
    """``error`` (type and message) and ``traceback`` (the last frames of it and of the
    exceptions it was raised from or during, at most ``limit`` characters) of ``e``."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6))
    if len(tb) > limit:
        tb = "..." + tb[-limit:]
    return {"error": f"{type(e).__name__}: {str(e)[:400]}", "traceback": tb}


def _cuda():
    """torch, where it is imported and has initialized CUDA (else None)."""
    torch = sys.modules.get("torch")
    try:
        return torch if torch is not None and torch.cuda.is_initialized() else None
    except Exception:
        return None


def cuda_healthy() -> bool:
    """Whether the CUDA context still runs work (True without CUDA)."""
    torch = _cuda()
    if torch is None:
        return True
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").add_(1).sum()) == 2.0
    except Exception:
        return False


def run_one(thunk, case_timeout: float):
    """(the thunk's result, None) or (None or its result, :func:`error_fields`) for one
    case under the watchdog; on CUDA the device is synchronized before the case counts as
    done, and a failure adds ``cuda_context_lost`` when the context no longer runs work."""
    got, err = None, None
    with watchdog(case_timeout):   # the health check too: a hung GPU hangs it
        try:
            got = thunk()
            torch = _cuda()
            if torch is not None:   # an asynchronous fault surfaces here, in its case
                torch.cuda.synchronize()
        except Exception as e:  # recorded and reported; the next case still runs
            err = error_fields(e)
            err["cuda_context_lost"] = not cuda_healthy()
    return got, err


def exit_if_context_lost(err, case_id: str):
    """After the row of a case that broke the CUDA context is written: end the process
    (device_session.sh resumes the cases left in a fresh one)."""
    if err and err.get("cuda_context_lost"):
        print(f"  {case_id}: the CUDA context is lost (sticky error); exiting with "
              f"{CONTEXT_LOST} so that the rest resumes in a fresh process", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(CONTEXT_LOST)


def table(rows, keys) -> str:
    """Rows as an aligned text table over ``keys`` (missing values blank)."""
    cells = [[_fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max([len(k)] + [len(c[i]) for c in cells]) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip() for cs in cells]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0")
    return str(v)


def environment() -> dict:
    """Versions and the GPU, for the JSON header."""
    env = {"python": sys.version.split()[0]}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["capability"] = list(torch.cuda.get_device_capability(0))
            env["gpus"] = torch.cuda.device_count()
    except ImportError:
        env["torch"] = None
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def add_job_options(ap, budget_s: float, timeout_s: float, interpret_help: str) -> None:
    """The command-line options the per-job device scripts share (gpu_kernels.py,
    gpu_tune.py): --interpret, --reps, --json, --budget-s, --case-timeout-s, --resume."""
    ap.add_argument("--interpret", action="store_true", help=interpret_help)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the rows here (rewritten after every job)")
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help="jobs not started within this many seconds are skipped")
    ap.add_argument("--case-timeout-s", type=float, default=None,
                    help=f"watchdog per job (default {timeout_s:g} on a GPU, off on "
                         f"--interpret)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in --json, skip their jobs")


def run_jobs(ap, args, make_jobs, timeout_s: float, describe) -> Results:
    """Run ``make_jobs(device)``'s (job id, thunk -> rows) pairs as the options in ``args``
    say (see :func:`add_job_options`): each under a watchdog, its rows (or its error) added
    with ``job`` and ``seconds``, the JSON rewritten after each, jobs not started within
    the budget listed in a "skipped" row. ``describe(rows)``: the line printed after a job
    that did not fail. Returns the finished :class:`Results`."""
    device = "cpu" if args.interpret else "cuda"
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU visible; use --interpret for the CPU smoke run")
    timeout = args.case_timeout_s if args.case_timeout_s is not None else (
        0 if device == "cpu" else timeout_s)
    res = Results(args.json, {}, resume=args.resume, as_list=True)
    budget, skipped = Budget(args.budget_s), []
    for job_id, job in make_jobs(device):
        if any(r.get("job") == job_id or job_id in r.get("skipped", ()) for r in res.rows):
            continue
        if budget.left() <= 0:
            skipped.append(job_id)
            continue
        kind = job_id.split("/")[0]
        res.start({"kernel": kind, "job": job_id})
        t = time.perf_counter()
        got, err = run_one(job, timeout)   # recorded; the next job still runs
        if err:
            got = [dict(err, kernel=kind, ok=False)]
        for r in got:
            r["job"] = job_id
            r["seconds"] = round(time.perf_counter() - t, 2)
            res.rows.append(r)
        res.doc["running"] = None
        res.write()
        exit_if_context_lost(err, job_id)
        print(f"  {job_id}: " + (f"ERROR {got[0]['error'][:200]}" if err else describe(got)) +
              f" ({time.perf_counter() - t:.1f} s)", flush=True)
    if skipped:
        res.add({"kernel": "skipped", "job": "skipped", "skipped": skipped,
                 "reason": f"the {args.budget_s:.0f} s budget ran out"})
        print(f"  NOTE: {len(skipped)} job(s) skipped, budget of {args.budget_s:.0f} s "
              f"spent: {', '.join(skipped)}", flush=True)
    res.finish()
    return res
