"""The `eins` command."""
from __future__ import annotations

import argparse
import os
import sys


def presets_help() -> str:
    """The topology presets, one line each, for ``--help`` (where --topology is taken)."""
    from eins.hardware.topology import _SWITCH, PRESETS
    lines = ["topology presets (--topology NAME; switch presets also NAME:N for N GPUs, "
             "clusters NAME:KxN):"]
    for name, topo in PRESETS.items():
        n = f"{len(topo.gpus)} GPUs" + (", :N" if name in _SWITCH else "")
        lines.append(f"  {name:<16} {n}")
    lines.append("  FILE.json        a topology written by `eins topology show NAME --json`")
    lines.append("default for eins.distribute: dgx-a100 up to 8 devices, clusters of dgx-a100 "
                 "above (dgx-a100:Kx8, up to 128 devices)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``eins`` command's parser, every subcommand registered (tests read its commands
    and flags to check the ones the docs name)."""
    parser = argparse.ArgumentParser(prog="eins", description=__doc__, epilog=presets_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: trace, plan and run the LLaMA block")
    p.set_defaults(func=lambda a: __import__("eins.demo", fromlist=["run"]).run(a))
    for mod in ("eins.commands",):
        try:
            m = __import__(mod, fromlist=["add_parsers"])
        except ImportError:
            continue
        m.add_parsers(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return rc
    except BrokenPipeError:
        # `eins ... | head`: the reader is gone. Exit quietly with the shell's SIGPIPE
        # status, and point stdout at /dev/null so the interpreter's final flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as e:  # clear one-line errors for eins's own errors
        from eins.errors import EinsError
        if isinstance(e, EinsError):
            print(f"eins: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
