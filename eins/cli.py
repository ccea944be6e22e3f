"""The `eins` command."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="eins", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: trace, plan and run the LLaMA block")
    p.set_defaults(func=lambda a: __import__("eins.demo", fromlist=["run"]).run(a))
    for mod in ("eins.commands",):
        try:
            m = __import__(mod, fromlist=["add_parsers"])
        except ImportError:
            continue
        m.add_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except Exception as e:  # clear one-line errors for eins's own errors
        from eins.errors import EinsError
        if isinstance(e, EinsError):
            print(f"eins: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
