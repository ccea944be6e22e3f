"""The `eins` command."""
from __future__ import annotations

import argparse
import os
import sys

from eins import demo
from eins.commands import add_parsers, presets_help  # exprog, topology, check, ...
from eins.errors import EinsError
from eins.models import command as plan_command
from eins.progress import set_verbose


class OneLineErrors(argparse.ArgumentParser):
    """An argument error is one line on stderr and exit status 2, as eins's own errors are
    (argparse printed its usage block first); ``--help`` still shows the usage. Subcommand
    parsers inherit the class."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--synthesis-steps 0`` was taken, and then
    ignored under the naive schedule)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {v}")
    return v


def eqn_or_all(text: str):
    """An argparse type: an eqn index (an int, negative from the end) or ``all``."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an eqn index or 'all', got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The ``eins`` command's parser, every subcommand registered (tests read its commands
    and flags to check the ones the docs name)."""
    parser = OneLineErrors(prog="eins", description=__doc__, epilog=presets_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log each step's time (-vv: each step's start too); on a "
                             "terminal a step past a second shows a progress bar")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: trace, plan and run the LLaMA block")
    p.set_defaults(func=demo.run)
    p = sub.add_parser(
        "plan", help="plan a paper workload (shape-only) and print its predicted time",
        epilog=presets_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan one of the paper's workloads shape-only on a hardware model and "
        "print the plan and its predicted time (no GPU needed).")
    p.add_argument("workload", help="a LLaMA token workload (1x1K, 1x8K, 1x128K, 8x1K, "
                   "128x1K, 8x1K-batch, 128x1K-batch) or a matrix chain (chain-A .. chain-E)")
    p.add_argument("--devices", type=int, default=8, help="GPUs to plan for (default 8)")
    p.add_argument("--topology", help="preset or topology .json file (default: dgx-a100 "
                   "sized to --devices)")
    p.add_argument("--schedule", choices=["naive", "optimized"], default="naive",
                   help="exchange programs: the paper's naive ones or synthesized")
    p.add_argument("--synthesis-steps", type=positive_int, default=None, metavar="N",
                   help="with --schedule optimized: candidates simulated per exchange "
                   "(default: the synthesizer's budget of modeled simulation time; either "
                   "way the same programs on any machine)")
    p.add_argument("--model", choices=["paper", "small", "tiny"], default="paper",
                   help="the LLaMA block's size (default: the paper's)")
    p.add_argument("--compare", action="store_true",
                   help="also predict every hand-written strategy that applies (token/"
                   "sequence parallel, Ulysses, Megatron TP, ...)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--explain", type=eqn_or_all, metavar="EQN",
                   help="why eqn EQN (or 'all' eqns) got its split: the next-best splits, "
                   "their costs and why each lost")
    p.add_argument("--html", metavar="FILE", help="write the plan as one self-contained "
                   "HTML page (with --compare: the strategies side by side)")
    p.add_argument("--trace", metavar="FILE", help="write the predicted schedule as a "
                   "Perfetto / Chrome trace (JSON)")
    p.set_defaults(func=plan_command.run)
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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:   # --help (0) or an argument error (2, its one line printed)
        return e.code if isinstance(e.code, int) else 2
    if args.verbose:
        set_verbose(min(args.verbose, 2))
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
        if isinstance(e, EinsError):
            print(f"eins: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
