"""The hybrimoe command line: run, serve, info, make-tiny-model, trace, simulate, synth, calibrate, bench.

Flags follow llama.cpp's tools (``-m -p -n -t -c -ngl -ub --seed --temp -ot --n-cpu-moe --rpc``); hybrimoe's
own flags start with ``--moe-``. One module per subcommand, each of one shape: ``HELP`` (one line), optionally
``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> exit status``. Nothing in the library imports this
package; an ImportError inside a command is a bug and propagates (only the server's optional packages are reported
as a missing extra, by ``serve`` itself).
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import warnings

from hybrimoe._lazy import lazy_submodules
from hybrimoe.commands.args import HelpFormatter, closest, unrecognized
from hybrimoe.commands.llama_args import one_line_warning

#: the subcommands, in the order ``--help`` lists them
COMMANDS = ("run", "serve", "info", "make-tiny-model", "trace", "simulate", "synth", "calibrate", "bench")
__getattr__ = lazy_submodules(__name__, tuple(c.replace("-", "_") for c in COMMANDS) + ("rpc_server", "args",
                                                                                       "llama_args"))


def command_module(name: str):
    """The module of subcommand ``name`` (``make-tiny-model`` is ``hybrimoe.commands.make_tiny_model``)."""
    return importlib.import_module(f"hybrimoe.commands.{name.replace('-', '_')}")


class _Parser(argparse.ArgumentParser):
    """The ``hybrimoe`` parser. argparse leaves a flag that the chosen command does not know to the top level, which
    reports it with the top level's usage; here the command's own parser reports it, with the command's usage and
    the closest flag. A mistyped command name gets the closest command."""

    def parse_args(self, args=None, namespace=None):
        """argparse's ``parse_args`` with those two messages; exits with status 2 after printing them."""
        argv = sys.argv[1:] if args is None else list(args)
        commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        word = next((a for a in argv if not a.startswith("-")), None)
        match = closest(word, commands.choices) if word is not None and word not in commands.choices else None
        if match:
            self.error(f"argument command: invalid choice: {word!r}; did you mean {match!r}? (choose from "
                       f"{', '.join(map(repr, commands.choices))})")
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            sub = commands.choices[parsed.command]
            sub.error(unrecognized(sub, extras))
        return parsed


def build_parser() -> argparse.ArgumentParser:
    """The ``hybrimoe`` parser with every subcommand (``args.func`` is the chosen command's ``run``)."""
    parser = _Parser(prog="hybrimoe", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)
    for name in COMMANDS:
        mod = command_module(name)
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


class OutputError(Exception):
    """Writing the command's standard output failed (a full disk, a closed pipe): ``error`` is the OSError."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _GuardedStream:
    """Standard output whose write and flush failures raise :class:`OutputError`, so that :func:`main` tells them
    from the command's own OSErrors (a model file that cannot be read)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputError(e) from None

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputError(e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Points file descriptor 1 at /dev/null, so that the interpreter's last flush of what is still buffered cannot
    fail again (and print "Exception ignored")."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.__stdout__.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """``hybrimoe``: parses the flags and runs the command. Returns its exit status; 130 after Ctrl-C; a closed
    pipe on stdout ends the command quietly with 141 (as a process killed by SIGPIPE); any other failure to write
    stdout (a full disk) is one ``hybrimoe <command>: error:`` line and status 1."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the error (status 2) or the help (0)
        return e.code if isinstance(e.code, int) else 2
    # every command prints the library's warnings as one line each in the CLI's style (not Python's file:line form)
    real_format, warnings.formatwarning = warnings.formatwarning, one_line_warning
    real_stdout = sys.stdout
    sys.stdout = _GuardedStream(real_stdout)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        return 130
    except (OutputError, BrokenPipeError) as e:
        err = e.error if isinstance(e, OutputError) else e
        _silence_stdout()
        if isinstance(err, BrokenPipeError) or err.errno == errno.EPIPE:
            return 141
        print(f"hybrimoe {args.command}: error: cannot write the output: {err.strerror or err}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = real_stdout
        warnings.formatwarning = real_format
