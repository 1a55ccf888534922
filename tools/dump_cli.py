"""graphzero-dump: inspect the dump directory that the graphzero backend writes.

The command line only: argument parsing, `graphzero-dump run` (starts the user's script with dumping
on) and choosing the view. Reading the dump is dump_model.py, the text and JSON views dump_views.py,
the HTML report dump_html.py. The directory layout and `summary.json` schema are specified in
docs/dump-format.md. None of these modules imports torch or graphzero, so that the CLI starts fast
and works while the backend is broken.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .dump_model import PROG, Dump, DumpError, open_dumps, select_dump, select_graph, select_pass
from .dump_views import code_view, diff_view, render_tables, tables_json

log = logging.getLogger(__name__)

EXAMPLES = """\
examples:
  graphzero-dump ./dump                        engine table of every graph
  graphzero-dump ./dump --json                 the same as JSON
  graphzero-dump ./dump --rank 1               one rank of a dump_ranks="all" dump
  graphzero-dump ./dump --pass bucket          backward code after pass "bucket" (only graph)
  graphzero-dump ./dump --graph g1 --pass bucket --diff
                                               what pass "bucket" changed in graph g1
  graphzero-dump ./dump --html report.html     self-contained HTML report
  graphzero-dump run train.py --epochs 1       run a script with dumping on, then the table
  graphzero-dump run -n 2 --dump-dir d train.py
                                               the same with torch.distributed.run, 2 processes

A dump directory that is literally called "run" must be given as ./run.
"""

RUN_EXAMPLES = """\
Options of graphzero-dump go before SCRIPT; everything after SCRIPT is passed to the script.
The script runs with GRAPHZERO_DUMP_DIR set; with -n > 1 it is started by
`python -m torch.distributed.run --nproc-per-node N --standalone SCRIPT ARGS`.
A non-zero exit code of the script is returned by graphzero-dump.

examples:
  graphzero-dump run train.py --lr 1e-3
  graphzero-dump run -n 2 --dump-dir ./dump train.py
  graphzero-dump run --html report.html train.py
"""


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by the view and `run` parsers."""
    parser.add_argument("--graph", metavar="ID", help="only graph ID (default: all; --pass: the only one)")
    parser.add_argument("--rank", metavar="K", type=int, help='only rank K of a dump_ranks="all" dump')
    parser.add_argument("--pass", dest="pass_name", metavar="NAME", help="the backward code after pass NAME")
    parser.add_argument("--diff", action="store_true", help="with --pass: unified diff before/after the pass")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    out.add_argument("--html", metavar="OUT", help="write a self-contained HTML report to OUT instead")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")


def build_view_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a graphzero dump directory (see docs/dump-format.md). "
        f"To run a script with dumping on, use `{PROG} run --help`.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", metavar="DIR", help="dump directory (GRAPHZERO_DUMP_DIR, options['dump_dir'])")
    add_output_options(parser)
    return parser


def build_run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} run",
        description="Run a training script with graphzero dumping on, then show the dump.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nproc", type=int, default=1, metavar="N", help="processes (default 1)")
    parser.add_argument("--dump-dir", metavar="D", help="dump directory (default: a new temporary one)")
    add_output_options(parser)
    parser.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="script arguments")
    return parser


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.diff and not args.pass_name:
        parser.error("--diff needs --pass NAME")
    if args.html and args.pass_name:
        parser.error("--html writes the whole report; it does not take --pass")


def show(args: argparse.Namespace, dumps: Sequence[Dump], root: Path) -> None:
    """Write the view the options ask for (table, code, diff, JSON or HTML)."""
    if args.html:
        from .dump_html import write_html  # the report's code loads only when asked for

        write_html(Path(args.html), dumps, args.graph)
        return
    if args.pass_name:
        graph = select_graph(select_dump(dumps), args.graph)
        index = select_pass(graph, args.pass_name)
        text = (diff_view if args.diff else code_view)(graph, index, args.json)
    elif args.json:
        text = json.dumps(tables_json(dumps, root, args.graph), indent=2)
    else:
        text = render_tables(dumps, args.graph)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def build_run_command(nproc: int, script: str, script_args: Sequence[str]) -> list[str]:
    """The command that runs `script`: plain Python, or torch.distributed.run for nproc > 1."""
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
        return [sys.executable, *launcher, script, *script_args]
    return [sys.executable, script, *script_args]


def exit_status(returncode: int) -> tuple[int, str]:
    """(exit code to propagate, how the script ended) for a subprocess return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return 128 - returncode, f"was killed by {name}"
    return returncode, f"exited with code {returncode}"


def script_stdout(as_json: bool) -> int | None:
    """With --json the script's stdout goes to our stderr so that stdout stays valid JSON."""
    if not as_json:
        return None
    try:
        return sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return subprocess.DEVNULL


def run_script(args: argparse.Namespace) -> Path:
    """Run the user's script with GRAPHZERO_DUMP_DIR set; return the dump directory."""
    if not Path(args.script).is_file():
        raise DumpError(f"{args.script}: no such script", code=1)
    if args.dump_dir:
        dump_dir = Path(args.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    else:
        dump_dir = Path(tempfile.mkdtemp(prefix="graphzero-dump-"))
        print(f"{PROG}: dump directory: {dump_dir}", file=sys.stderr)
    command = build_run_command(args.nproc, args.script, args.script_args)
    log.debug("running %s with GRAPHZERO_DUMP_DIR=%s", shlex.join(command), dump_dir)
    env = {**os.environ, "GRAPHZERO_DUMP_DIR": str(dump_dir)}
    try:
        result = subprocess.run(command, env=env, stdout=script_stdout(args.json), check=False)
    except OSError as exc:
        raise DumpError(f"cannot start {command[0]}: {exc.strerror or exc}", code=1) from None
    if result.returncode != 0:
        code, how = exit_status(result.returncode)
        raise DumpError(f"{args.script} {how}", code=code)
    return dump_dir


def run_main(argv: Sequence[str]) -> None:
    """`graphzero-dump run ...`."""
    parser = build_run_parser()
    args = parser.parse_args(argv)
    check_options(parser, args)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    configure_logging(args.verbose)
    dump_dir = run_script(args)
    try:
        dumps = open_dumps(dump_dir, args.rank)
    except DumpError as exc:
        raise DumpError(f"{args.script} finished but left no usable dump: {exc}", code=1) from None
    show(args, dumps, dump_dir)


def view_main(argv: Sequence[str]) -> None:
    """`graphzero-dump DIR ...`."""
    parser = build_view_parser()
    args = parser.parse_args(argv)
    check_options(parser, args)
    configure_logging(args.verbose)
    root = Path(args.dir)
    show(args, open_dumps(root, args.rank), root)


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format=f"{PROG}: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `graphzero-dump` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["run"]:
            run_main(argv[1:])
        else:
            view_main(argv)
    except DumpError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # e.g. `graphzero-dump DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # e.g. an unreadable dump directory
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
