"""The command line's one error style, its exit codes and Ctrl-C.

:class:`BagstoreGroup` is the class of the ``bagstore`` group: every error of every
command comes out as one red ``error: ...`` line on stderr, never a traceback, with
the exit codes of :mod:`bagstore.cli`'s docstring (0 done; 1 not found / problems
found / internal error; 2 bad input or a store error; 130 interrupted).  A command
whose work can be resumed after Ctrl-C says so with :func:`resumable`, and the
interrupt's line names the command that resumes it::

    error: interrupted; resume with: bagstore --store data shard resume

An unexpected exception is a bug: ``error: internal error: TYPE: MESSAGE`` (exit 1);
``BAGSTORE_DEBUG=1`` lets its traceback through.
"""

from __future__ import annotations

import codecs
import errno
import io
import os
import shlex
import sys
from contextvars import ContextVar
from typing import IO, Any

import click
from click.core import ParameterSource

from bagstore.cli_json import JsonInputError
from bagstore.errors import BagstoreError

__all__ = [
    "BagstoreGroup",
    "CliError",
    "Interrupted",
    "Numbers",
    "resumable",
    "shown",
    "utf8_output",
]


class Numbers(click.FloatRange):
    """click's ``FloatRange`` that refuses NaN as well (no comparison with a
    bound excludes it): an option's bad number is a usage error (exit 2)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number != number:
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


_LINE_BREAKS = {
    ord(c): c.encode("unicode_escape").decode("ascii")
    for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
}
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2
_RESUME: ContextVar[str | None] = ContextVar("bagstore_resume", default=None)
_ARGV: ContextVar[tuple[str, ...]] = ContextVar("bagstore_argv", default=())


def _one_line(text: str) -> str:
    """``text`` with line breaks and lone surrogates escaped: it prints as one line."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").translate(_LINE_BREAKS)


def shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut short when long."""
    quoted = repr(text)
    return quoted if len(quoted) <= limit else quoted[: limit - 4] + "...'"


def _error_line(message: str) -> None:
    click.echo(click.style(f"error: {_one_line(message)}", fg="red"), err=True)


class CliError(click.ClickException):
    """A failure the user can act on: one red ``error: ...`` line, exit code 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        _error_line(self.format_message())


class Interrupted(click.ClickException):
    """Ctrl-C: ``error: interrupted`` (and the command that resumes the work, when
    the command declared one with :func:`resumable`), exit code 130."""

    exit_code = 130

    def __init__(self, resume: str | None = None) -> None:
        super().__init__("interrupted" + (f"; resume with: {resume}" if resume else ""))

    def show(self, file: IO[Any] | None = None) -> None:
        _error_line(self.format_message())


def resumable(ctx: click.Context, *words: str) -> None:
    """Declare that Ctrl-C leaves this command's work resumable, and by what:
    ``bagstore WORDS`` (with the ``--config``/``--store`` given on the command line),
    or, without words, the same command line again."""
    if words:
        root = ctx.find_root()
        parts = ["bagstore"]
        for name in ("config", "store"):
            if root.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                parts += [f"--{name}", str(root.params[name])]
        parts += words
    else:
        parts = ["bagstore", *_ARGV.get()]
    _RESUME.set(shlex.join(parts))


def _usage_message(exc: click.UsageError) -> str:
    """click's usage error in our style: ``missing argument 'IDS' (try 'bagstore get --help')``."""
    message = exc.format_message().strip()
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    if message.endswith(".") and not message.endswith(".."):
        message = message[:-1]
    command = exc.ctx.command_path if exc.ctx is not None else "bagstore"
    return f"{message} (try '{command} --help')"


def _debug() -> bool:
    return os.environ.get("BAGSTORE_DEBUG", "") not in ("", "0")


class BagstoreGroup(click.Group):
    """The ``bagstore`` group: one error style and the exit codes of the module
    docstring for every command.

    ``invoke`` turns library errors (and file-system errors such as an
    unwritable store directory) and bad JSON raised by any subcommand into
    :class:`CliError`; ``main`` prints every error as one ``error: ...`` line --
    click's usage errors, Ctrl-C, and unexpected exceptions (bugs) too -- and
    exits with its code.  No traceback, unless ``BAGSTORE_DEBUG=1``.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (BagstoreError, JsonInputError) as exc:
            raise CliError(str(exc)) from exc
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # click handles a closed pipe itself
                raise
            raise CliError(str(exc)) from exc

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("standalone_mode", True):
            return super().main(*args, **kwargs)
        kwargs["standalone_mode"] = False
        given = args[0] if args else kwargs.get("args")
        argv = _ARGV.set(tuple(sys.argv[1:] if given is None else given))
        resume = _RESUME.set(None)
        try:
            code = self._run(*args, **kwargs)
        finally:
            _RESUME.reset(resume)
            _ARGV.reset(argv)
        sys.exit(code)

    def _run(self, *args: Any, **kwargs: Any) -> int:
        try:
            rv = super().main(*args, **kwargs)  # returns ctx.exit's code, or None
        except _NO_ARGS_IS_HELP as exc:
            exc.show()  # `bagstore shard`: the help on stderr, exit 2, as click does
            return int(exc.exit_code)
        except click.UsageError as exc:
            _error_line(_usage_message(exc))
            return 2
        except (CliError, Interrupted) as exc:
            exc.show()
            return exc.exit_code
        except click.ClickException as exc:
            _error_line(exc.format_message())
            return 2
        except (click.Abort, KeyboardInterrupt):
            Interrupted(_RESUME.get()).show()
            return 130
        except (BagstoreError, OSError) as exc:  # e.g. closing the store
            _error_line(str(exc))
            return 2
        except Exception as exc:
            if _debug():
                raise
            message = str(exc) if len(str(exc)) <= 500 else str(exc)[:497] + "..."
            _error_line(
                f"internal error: {type(exc).__name__}: {message} "
                "(a bug; rerun with BAGSTORE_DEBUG=1 for the traceback)"
            )
            return 1
        return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0


def utf8_output() -> None:
    """stdout and stderr write UTF-8 (JSON's encoding) whatever the locale, and
    escape what cannot be written rather than fail."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            utf8 = codecs.lookup(stream.encoding).name == "utf-8"
            stream.reconfigure(encoding=None if utf8 else "utf-8", errors="backslashreplace")
