"""The `eins` command."""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``eins`` command's parser, every subcommand registered (tests read its commands
    and flags to check the ones the docs name)."""
    from eins.commands import add_parsers, presets_help  # exprog, topology, check, ...
    parser = argparse.ArgumentParser(prog="eins", description=__doc__, epilog=presets_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: trace, plan and run the LLaMA block")
    p.set_defaults(func=lambda a: __import__("eins.demo", fromlist=["run"]).run(a))
    add_parsers(sub)
    return parser


def command_tree(parser: argparse.ArgumentParser | None = None) -> tuple[set, dict]:
    """(the option strings of ``parser``, {subcommand: its own command_tree}) of the ``eins``
    command, for tests that check the commands and flags the docs name."""
    parser = parser or build_parser()
    flags = set(parser._option_string_actions)
    subs = {}
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            subs = {name: command_tree(p) for name, p in act.choices.items()}
    return flags, subs


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
