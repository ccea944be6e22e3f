"""The ``eins exprog`` and ``eins topology`` subcommands (issue 3, "Command line").

    eins exprog check FILE
    eins exprog simulate FILE --topology NAME [--trace out.json] [--json]
    eins exprog synthesize FILE --topology NAME [--budget SECONDS] [--json]
    eins topology show NAME [--json]
    eins topology parse FILE --gpu NAME [--nodes N [--nic-gbits GBITS]] [--json]
    eins calibrate [--from DIR ...] [--gpu NAME] [--out PROFILE.json] [--rows ROWS.json]

``--topology`` takes a preset (``dgx-h100``, ``dgx-h100:4``) or a topology ``.json`` file.
Errors are :class:`EinsError` subclasses, which ``eins.cli`` prints as one line (exit 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from eins.api import distribute
from eins.cost import calibrate as cal
from eins.cost import microbench
from eins.errors import EinsError, ExProgError, GpuError, OutputError, TopologyError
from eins.hardware.presets import PRESETS, SWITCH_PRESETS, get_topology
from eins.hardware.specs import gpu_spec
from eins.hardware.simulate import simulate
from eins.hardware.topology import Topology
from eins.ir import exprog
from eins.ir.plan import Tuning
from eins.ops import silu
from eins.passes.synthesize import synthesize_program


def presets_help() -> str:
    """The topology presets, one line each, for ``--help`` (where --topology is taken)."""
    lines = ["topology presets (--topology NAME; switch presets also NAME:N for N GPUs, "
             "clusters NAME:KxN):"]
    for name, topo in PRESETS.items():
        n = f"{len(topo.gpus)} GPUs" + (", :N" if name in SWITCH_PRESETS else "")
        lines.append(f"  {name:<16} {n}")
    lines.append("  FILE.json        a topology written by `eins topology show NAME --json`")
    lines.append("default for eins.distribute: dgx-a100 up to 8 devices, clusters of dgx-a100 "
                 "above (dgx-a100:Kx8, up to 128 devices)")
    return "\n".join(lines)


def add_parsers(sub) -> None:
    """Register ``exprog`` and ``topology`` on the ``eins`` command's subparsers; every
    parser that takes a topology lists the presets in its ``--help``."""
    names = ", ".join(PRESETS)
    topo_help = f"preset ({names}; switch presets also NAME:N) or topology .json file"
    withp = {"epilog": presets_help(), "formatter_class": argparse.RawDescriptionHelpFormatter}
    ex = sub.add_parser("exprog", help="exchange programs (paper Section 5.2)", **withp)
    exs = ex.add_subparsers(dest="exprog_command", required=True)

    p = exs.add_parser("check", help="check a program (Definition 5.5) and find a membership")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_check)

    p = exs.add_parser("simulate", help="simulate a program on a hardware model", **withp)
    p.add_argument("file")
    p.add_argument("--topology", required=True, help=topo_help)
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_simulate)

    p = exs.add_parser("synthesize", help="synthesize the fastest body for a preamble", **withp)
    p.add_argument("file")
    p.add_argument("--topology", required=True, help=topo_help)
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="search budget in seconds of modeled simulation (default 0.2; the "
                   "same body on any machine)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_synthesize)

    tp = sub.add_parser("topology", help="hardware models", **withp)
    tps = tp.add_subparsers(dest="topology_command", required=True)
    p = tps.add_parser("show", help="describe a preset or topology .json file", **withp)
    p.add_argument("name", help=topo_help)
    p.add_argument("--json", action="store_true", help="print the topology as JSON")
    p.set_defaults(func=_topology_show)
    p = tps.add_parser("parse", help="read `nvidia-smi topo -m` output")
    p.add_argument("file")
    p.add_argument("--gpu", required=True, help="GPU model, e.g. V100, A100, H100, B200")
    p.add_argument("--nodes", type=int, default=1,
                   help="a cluster of N such servers, one NIC per GPU, rail-optimized")
    p.add_argument("--nic-gbits", type=float, metavar="GBITS",
                   help="each GPU's NIC in Gb/s (default: the GPU model's, e.g. 400 for H100)")
    p.add_argument("--json", action="store_true",
                   help="print the topology as JSON (loadable with --topology FILE.json)")
    p.set_defaults(func=_topology_parse)

    p = sub.add_parser("calibrate", help="fit a machine profile to measured kernel times "
                       "(on this machine's GPU, or from measurement files)")
    p.add_argument("--from", dest="dirs", nargs="+", metavar="DIR",
                   help="fit to these folders' measurements (calibrate_rows.json written "
                   "by an earlier `eins calibrate --rows`, or benchmarks/gpu_kernels.py's "
                   "gpu_kernels.json) instead of measuring; runs are combined")
    p.add_argument("--gpu", help="the GPU model measured (default: this GPU, or the "
                   "folders' gpu_check.json)")
    p.add_argument("--name", help="the profile's name (default: the GPU model, lower case)")
    p.add_argument("--out", metavar="PROFILE.json", help="write the profile here (default: "
                   "print it)")
    p.add_argument("--rows", metavar="ROWS.json", help="also write the measurement rows")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a short GPU run)")
    p.set_defaults(func=_calibrate)


def _read(path, error) -> str:
    """The text of ``path`` (UTF-8); unreadable or undecodable (binary) input is ``error``."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                    f"{e.start}); expected an exchange program or `nvidia-smi topo -m` "
                    f"output") from None


def _load(path):
    return exprog.parse(_read(path, ExProgError))


def _members_text(members) -> list[str]:
    return [f"  {k} = {{{', '.join(map(str, v))}}}" for k, v in members.items()]


def _check(args):
    prog = _load(args.file)
    try:
        members = exprog.check(prog)
    except ExProgError as e:
        if prog.actions:
            raise
        raise ExProgError(f"{e}; the program has no actions (a preamble?): "
                          f"`eins exprog synthesize {args.file} --topology NAME` writes "
                          f"its body") from None
    if args.json:
        print(json.dumps({"valid": True, "partitions": {k: list(v) for k, v in
                                                         members.items()}}))
        return 0
    n = len(prog.actions)
    print(f"{args.file}: valid ({n} action{'' if n == 1 else 's'})")
    if members:
        print("partitions:")
        print("\n".join(_members_text(members)))
    return 0


def _simulate(args):
    prog = _load(args.file)
    topo = get_topology(args.topology)
    res = simulate(prog, topo)
    if args.trace is not None:   # '' too: an empty path is an error, not "no trace"
        try:
            res.to_chrome_trace(args.trace)
        except OSError as e:
            raise OutputError(f"cannot write trace {args.trace!r}: {e.strerror}") from None
    if args.json:
        print(json.dumps({"topology": topo.name, **res.to_dict()}, indent=1))
        return 0
    print(f"{args.file} on {topo.name}: {res.total_s * 1e3:.3f} ms "
          f"(transfers active {res.transfer_s * 1e3:.3f} ms)")
    if res.membership:
        print("partitions:")
        print("\n".join(_members_text(res.membership)))
    print(f"  {'start ms':>9} {'end ms':>9}  {'kind':<9} {'sites':<8} {'GB':>6}  action")
    for e in res.timeline:
        sites = "->".join(map(str, e.sites))
        print(f"  {e.start_s * 1e3:9.3f} {e.end_s * 1e3:9.3f}  {e.kind:<9} {sites:<8} "
              f"{e.bytes / 1e9:6.3g}  {e.text}")
    if args.trace is not None:
        print(f"trace written to {args.trace}")
    return 0


def _synthesize(args):
    prog = _load(args.file)
    topo = get_topology(args.topology)
    if args.budget is not None and not 0 < args.budget < float("inf"):
        raise EinsError(f"--budget must be a positive, finite number of seconds, got "
                        f"{args.budget}")
    kw = {} if args.budget is None else {"budget_s": args.budget}
    res = synthesize_program(prog, topo, **kw)
    text = exprog.to_text(res.program)
    members = {k: tuple(v) for k, v in (res.membership or {}).items()}
    if args.json:
        print(json.dumps({"topology": topo.name, "total_ms": res.total_s * 1e3,
                          "naive_ms": res.naive_s * 1e3, "program": text,
                          "partitions": {k: list(v) for k, v in members.items()}}, indent=1))
        return 0
    print(text.rstrip("\n"))
    # nothing to move (both 0 s) is no speedup, as SynthResult.speedup says, not 'infx'
    speed = res.naive_s / res.total_s if res.total_s > 0 else 1.0
    print(f"# predicted {res.total_s * 1e3:.3f} ms on {topo.name}; naive "
          f"{res.naive_s * 1e3:.3f} ms ({speed:.2f}x)")
    for line in _members_text(members):
        print("#" + line[1:])
    return 0


def _show_topology(topo, as_json):
    if as_json:
        print(json.dumps(topo.to_dict(), indent=1))
    else:
        print(topo.describe())
    return 0


def _topology_show(args):
    return _show_topology(get_topology(args.name), args.json)


def _topology_parse(args):
    text = _read(args.file, TopologyError)
    if args.nic_gbits is not None and args.nodes == 1:
        raise TopologyError("--nic-gbits describes the NICs between nodes; give --nodes N "
                            "(N > 1) with it")
    return _show_topology(Topology.from_nvidia_smi(text, gpu=args.gpu, nodes=args.nodes,
                                                   nic_gbits=args.nic_gbits), args.json)


def _json_file(path, error=EinsError):
    try:
        return json.loads(_read(path, error))
    except ValueError as e:
        raise error(f"{path!r} is not valid JSON: {e}") from None


def _measured_gpu(dirs) -> str | None:
    for d in dirs:
        path = os.path.join(d, "gpu_check.json")
        if os.path.exists(path):
            gpu = (_json_file(path).get("env") or {}).get("gpu")
            if gpu:
                return gpu
    return None


def _calibrate(args):
    """``eins calibrate``: measurement rows (measured here, or read from ``--from``
    folders) fitted into a profile (eins/cost/calibrate.py)."""
    table = None
    if args.dirs:
        gpu = args.gpu or _measured_gpu(args.dirs)
        if gpu is None:
            raise EinsError("which GPU measured these? pass --gpu (e.g. H200)")
    else:
        try:
            import torch  # heavy: only a measuring run
        except ImportError:
            raise GpuError("eins calibrate measures on a GPU and needs torch (the gpu extra); "
                           "without one, fit to measurement files with --from DIR") from None
        if not torch.cuda.is_available():
            raise GpuError("eins calibrate measures on a GPU and torch sees none; without "
                           "one, fit to measurement files with --from DIR")
        gpu = args.gpu or torch.cuda.get_device_name(0)
    model, spec = gpu_spec(gpu)
    topo = get_topology(Topology.build(model, [0], hbm_bw=spec["hbm"], flops=spec["flops"],
                                       memory=spec["memory"], gpu_model=model))
    rows = []
    if args.dirs:
        table = {}
        for d in args.dirs:
            own = os.path.join(d, "calibrate_rows.json")
            if os.path.exists(own):
                doc = _json_file(own)
                rows += doc["rows"]
                got = doc.get("attention", {})
            else:
                kernels = _json_file(os.path.join(d, "gpu_kernels.json"))
                rows += cal.rows_from_kernels(kernels, topo, source=os.path.basename(d))
                got = cal.attention_table(kernels)
            for impl, t in got.items():
                for k, v in t.items():
                    table.setdefault(impl, {}).setdefault(k, []).append(v)
        table = {i: {k: round(statistics.median(v), 4) for k, v in sorted(t.items())}
                 for i, t in sorted(table.items())}
        source = (f"eins calibrate --from {' '.join(args.dirs)}: graph-replayed times, the "
                  f"median over runs and dtypes")
    else:
        rows, table = microbench.run(topo, quick=args.quick)
        kernels_only = cal.fit(rows, flops=topo.flops, hbm_bw=topo.hbm_bw, name="kernels")
        rows += shared_rows(topo, kernels_only)
        source = f"eins calibrate on {gpu}: graph-replayed micro-benchmarks"
    prof = cal.fit(rows, flops=topo.flops, hbm_bw=topo.hbm_bw, name=args.name or model.lower(),
                   gpu=model, source=source, attention=table)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump({"gpu": gpu, "rows": rows, "attention": table}, f, indent=1)
    for r in cal.shape_points(rows):
        pred = cal.predicted_seconds(prof, r, topo.flops, topo.hbm_bw)
        print(f"# {r['class']:<11} {r['what']:<44} measured {r['seconds'] * 1e3:9.4f} ms "
              f"(x{r['runs']}), fitted {pred * 1e3:9.4f} ms")
    if args.out:
        prof.to_json(args.out)
        print(f"# wrote {args.out}")
    else:
        print(prof.to_json(), end="")


SHARED_P = 8   # logical devices of the shared-GPU measurement


def shared_rows(topo, kernel_profile, backend="cuda", tokens=4096, d=4096, f=14336, reps=10,
                dtype="float16") -> list:
    """"shared" measurement rows (eins/cost/calibrate.py): an FFN, ``silu(x @ w1) @ w2``,
    planned for SHARED_P logical devices on GPU 0 alone (``topo.logical``), its weights
    placed, CUDA graphs on, timed per call (median of ``reps``) against the kernel model
    priced by ``kernel_profile``; ``kernels``: the launches the model counts on the GPU.
    ``backend="interpret"``: the same path on the CPU (wall-clock times; a smoke test)."""
    import torch  # heavy: only a measuring run
    shared = dataclasses.replace(topo, profile=kernel_profile).logical(SHARED_P)
    dev = "cuda" if backend == "cuda" else "cpu"
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    x, w1, w2 = (torch.randn(m, n, generator=gen, device=dev).to(tdt) / n ** 0.5
                 for m, n in ((tokens, d), (d, f), (f, d)))
    # every logical device busy (what is measured), not the subset the planner would take
    low = distribute(lambda x, w1, w2: silu(x @ w1) @ w2, devices=SHARED_P,
                     topology=shared, tuning=Tuning(device_subsets=False)).lower(x, w1, w2)
    c = low.compile(backend, device_map={k: 0 for k in range(SHARED_P)}, graphs=True)
    c.place(x, w1, w2)
    times = []
    for i in range(reps + 2):   # two warm-up calls: compiles and the graph's capture
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            c(x, w1, w2)
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            c(x, w1, w2)
            t = time.perf_counter() - t0
        if i >= 2:
            times.append(t)
    kernels = sum(len(ep.spec.fspecs) for e, ep in zip(low.program.eqns, low.plan.eqn_plans)
                  if not kernel_profile.entry(e.primitive.kernel_class).folded)
    return [{"what": f"ffn {tokens}x{d}x{f} p={SHARED_P} on one GPU", "class": "shared",
             "dtype": dtype, "seconds": statistics.median(times),
             "model_seconds": low.predicted_time()["total_ms"] / 1e3, "kernels": kernels}]
