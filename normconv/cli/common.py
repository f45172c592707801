"""What every normconv command shares: option types, loading from flags, error handling, report output.

Exit codes: 0 ok, 1 verification failed (nothing written), 2 bad input, 3 internal error (a normconv bug).

Importing the command line imports neither torch nor the report's renderers: each command imports what it runs
when it runs (``normconv --version`` and ``--help`` stay light; tests/test_cli_imports.py holds it).

stdout is normconv's: while a command runs, whatever the model prints (its forward, its factory, a library it
calls, Python or C) goes to stderr (``model_output_to_stderr``); only the report (``emit``) reaches stdout, so
``--json`` is one JSON object whatever the model does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from normconv.errors import EXIT_BAD_INPUT, NormconvError, VerificationError
from normconv.quiet import collector_frozen_at_phases, end_progress, phase, progress_display

if TYPE_CHECKING:
    import torch

    from normconv.io.load import Loaded
    from normconv.report import Report

EXIT_INTERNAL = 3
EXIT_READER_GONE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose pipe's reader went away

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="zoo:NAME, a Hugging Face folder, a .pt2 program, a pickled module (.pt), "
                          "or package.module:factory", show_default=False)]
WeightsOpt = Annotated[Optional[str], typer.Option(
    "--weights", help="state_dict (.pt) or .safetensors for a package.module:factory model")]
InputShapeOpt = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", "-i", help="example input NAME:D0,D1,...[:DTYPE] (repeatable), e.g. x:1,3,224,224; one input may "
                                 "leave out NAME: 1,3,224,224")]
TrustOpt = Annotated[bool, typer.Option(
    "--trust-pickle", help="allow loading a full pickled module (runs code from the file)")]
TrustCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", help="allow a Hugging Face folder's own model code (config auto_map) to run")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="cast model and float inputs first: float32, float16, bfloat16, float64")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
OutputOpt = Annotated[Optional[str], typer.Option(
    "--output", "-o", help="where to write the result (default: nothing is written)")]
BenchOpt = Annotated[bool, typer.Option(
    "--bench", help="also time the model before and after (median of 5 eager forwards each)")]
KeepNormconvOpt = Annotated[bool, typer.Option(
    "--normconv-modules", help="keep normconv's faster eager modules in the written model (loading it then needs "
                               "normconv; default: torch's own modules, loads with torch alone)")]
InPlaceOpt = Annotated[bool, typer.Option("--in-place", help="allow -o to overwrite the input file")]
OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="replace an existing output (a file or a folder), atomically; never one the command read")]
StaticOpt = Annotated[bool, typer.Option(
    "--static", help="a written .pt2 takes the example's shapes only (default: every input dimension the model lets "
                     "vary stays dynamic, each checked at a second size)")]
AtolOpt = Annotated[Optional[float], typer.Option("--atol", min=0.0, help="absolute tolerance (default by dtype: fp32 1e-4)")]
AcceptSpecializedOpt = Annotated[bool, typer.Option(
    "--accept-specialized", help="accept a rewrite whose capture took a branch on tensor values as the example "
                                 "inputs take it, unproven for the other branch (default: proven or refused)")]
RtolOpt = Annotated[Optional[float], typer.Option("--rtol", min=0.0, help="relative tolerance (default by dtype: fp32 1e-4)")]
ConstantInitializersOpt = Annotated[bool, typer.Option(
    "--constant-initializers", help="an .onnx input: read the initializers it also lists as graph inputs (defaults a "
                                    "caller could override) as the constants they hold, so their BatchNorms fold; "
                                    "they are no inputs of the output")]


def is_onnx(spec: str) -> bool:
    """An ONNX file (inspect, fold and export take those down their own path), by name: nothing is imported."""
    return str(spec).lower().endswith(".onnx")


def load_from_flags(model: str, weights: Optional[str], input_shape: Optional[list[str]], trust_pickle: bool,
                    dtype: Optional[str], trust_remote_code: bool = False) -> Loaded:
    from normconv.io.load import load

    phase("load", detail=model)
    if is_onnx(model):  # inspect, fold and export dispatch ONNX files before they get here
        raise NormconvError(f"{model} is an ONNX file: normconv inspect, fold and export read ONNX files; this "
                            f"command rewrites PyTorch models (give it the model the file was exported from)")
    loaded = load(model, weights=weights, input_shapes=input_shape, trust_pickle=trust_pickle, dtype=dtype,
                  trust_remote_code=trust_remote_code)
    loaded.disposable = True  # loaded here from a file, seen by no one else: rewrites need not copy what they change
    return loaded


def load_half_target(model: str, weights: Optional[str], input_shape: Optional[list[str]], trust_pickle: bool,
                     dtype: Optional[str], trust_remote_code: bool = False) -> tuple[Loaded, Optional[torch.dtype]]:
    """``--dtype float16 / bfloat16`` names the target of a half-precision command: the model loads as given (its
    float32 form is the reference the command measures and verifies against) and the half dtype comes back; any
    other ``--dtype`` casts at load as usual."""
    from normconv.graph.headroom import HALF_DTYPES

    half = HALF_DTYPES.get((dtype or "").lower())
    return load_from_flags(model, weights, input_shape, trust_pickle, None if half else dtype, trust_remote_code), half


def options_from_flags(output: Optional[str] = None, atol: Optional[float] = None, rtol: Optional[float] = None,
                       in_place: bool = False, bench: bool = False, normconv_modules: bool = False,
                       eval_mode: bool = False, dtype: Optional[torch.dtype] = None, accept_specialized: bool = False,
                       static: bool = False, overwrite: bool = False):
    """The shared options of one command run, from its flags (``normconv.options.Options``)."""
    from normconv.options import Options

    return Options(atol=atol, rtol=rtol, output=output, in_place=in_place, bench=bench,
                   keep_normconv=normconv_modules, eval_mode=eval_mode, dtype=dtype,
                   accept_specialized=accept_specialized, static=static, overwrite=overwrite)


def refuse_flags(what: str, flags: list[tuple[str, bool]]) -> None:
    """The flags set in ``flags`` (name, given) that a path of a command cannot honour, refused in one line before
    anything is read: a flag is obeyed or refused, never dropped."""
    unsupported = [flag for flag, on in flags if on]
    if unsupported:
        raise NormconvError(f"{what}: {', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not "
                            f"supported with it")


def onnx_only(flags: list[tuple[str, bool]]) -> None:
    """The flags set in ``flags`` (name, given) that only an .onnx input honours, given with a torch model: refused
    in one line before anything is read."""
    given = [flag for flag, on in flags if on]
    if given:
        raise NormconvError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with an .onnx input only")


def check_stream_flags(what: str, flags: list[tuple[str, bool]], output: Optional[str]) -> None:
    """``--stream`` reads a Hugging Face folder and writes a new one (-o): the flags it cannot honour (those set
    in ``flags``) and a missing -o are refused in one line, before anything is read."""
    refuse_flags(f"--stream {what} only", flags)
    if output is None:
        raise NormconvError("--stream writes a new folder: give it with -o")


_REAL_STDOUT: list[tuple[object, int | None, int | None]] = []  # (sys.stdout, its fd, a dup of what that fd was)


@contextlib.contextmanager
def model_output_to_stderr():
    """stdout goes to stderr inside the block, as a Python stream and, where stdout is a real file descriptor, at
    the descriptor too (a C extension's printf, a subprocess); ``report_stdout`` gives it back to the report."""
    real = sys.stdout
    fd = saved = None
    try:
        fd = real.fileno()
        err = sys.stderr.fileno()
        real.flush()
        saved = os.dup(fd)
        os.dup2(err, fd)
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test runner's): Python only
        fd = saved = None
    _REAL_STDOUT.append((real, fd, saved))
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        _restore(real, fd, saved)
        _REAL_STDOUT.pop()


def _restore(real, fd: int | None, saved: int | None, close: bool = True) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    sys.stdout = real
    if saved is not None:
        os.dup2(saved, fd)
        if close:
            os.close(saved)


@contextlib.contextmanager
def report_stdout():
    """The real stdout inside the block (for the report), back to stderr after it."""
    if not _REAL_STDOUT:
        yield
        return
    real, fd, saved = _REAL_STDOUT[-1]
    _restore(real, fd, saved, close=False)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            real.flush()
        if saved is not None:
            os.dup2(sys.stderr.fileno(), fd)
        sys.stdout = sys.stderr


_SHOW_PROGRESS = [True]  # the global --quiet turns it off (normconv.cli's callback)


def show_progress(on: bool) -> None:
    _SHOW_PROGRESS[0] = on


def progress_wanted() -> bool:
    """A progress display on stderr while a command runs: unless --quiet, and only where stderr is a terminal."""
    try:
        return _SHOW_PROGRESS[0] and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def emit(report: Report, as_json: bool, printer: Callable[[Report], None] | None = None,
         error: dict[str, Any] | None = None) -> None:
    """The report on stdout: tables, or with ``as_json`` one JSON object (``error``: a failed run's keys added)."""
    from normconv.report import print_json, print_report

    end_progress()  # the display is gone before the report prints
    printer = printer or print_report
    with report_stdout():
        if as_json:
            print_json(report, error)
        else:
            printer(report)


def fail(message: str, code: int, as_json: bool = False, kind: str | None = None) -> None:
    """One line on stderr and the exit code; with ``--json`` also one object on stdout (``passed`` false, the
    message, its code, the exit code), so that stdout is always one JSON object."""
    end_progress()
    if as_json:
        json_error(message, code, kind)
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    raise typer.Exit(code)


def json_error(message: str, code: int, kind: str | None) -> None:
    """``--json``'s object for a run that ended in an error: stdout stays one JSON object."""
    import json

    sys.stdout.write(json.dumps({"passed": False, "error": message, "code": kind, "exit_code": code}) + "\n")


def reader_gone() -> None:
    """Exit quietly, as a shell's SIGPIPE does: what is left for stdout goes nowhere (flushing it at exit would fail
    again); anything the command wrote is already in place."""
    end_progress()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise typer.Exit(EXIT_READER_GONE)


class Terminated(SystemExit):
    """SIGTERM, raised where the process stands (``cli._terminated``): it unwinds as Ctrl-C does, every temp file
    removed on the way out, and ends as every failure does (one line, ``--json``'s object, exit 128 + 15)."""


def user_errors(fn: Callable) -> Callable:
    """Turn NormconvError into one line on stderr and its exit code; a verification failure prints its report."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        output = kwargs.get("output")
        if output == "":  # `-o "$OUT"` with $OUT unset: Path("") is the current folder, never a place to write
            fail("-o is empty (an unset variable?): name the file or folder to write", EXIT_BAD_INPUT, as_json, "usage")
        if isinstance(output, str) and output.startswith("-") and output != "-":  # `-o --json`: a flag taken as a path
            fail(f"-o {output}: an output path starting with '-' reads as a flag (was -o's value left out?); write "
                 f"./{output} for a file so named", EXIT_BAD_INPUT, as_json, "usage")
        try:
            # what the model prints never lands in the report (--json stays JSON); progress shows on stderr
            with model_output_to_stderr(), progress_display(progress_wanted()), collector_frozen_at_phases():
                return fn(*args, **kwargs)
        except VerificationError as exc:
            if exc.report is not None:  # its --json object says the error as every failure's does
                emit(exc.report, as_json, error={"error": str(exc), "code": exc.code.value, "exit_code": exc.exit_code})
            fail(str(exc), exc.exit_code, as_json and exc.report is None, exc.code.value)
        except NormconvError as exc:
            fail(str(exc), exc.exit_code, as_json, exc.code.value)
        except KeyboardInterrupt:
            fail("interrupted", 130, as_json, "interrupted")
        except Terminated as exc:
            fail("terminated (SIGTERM)", exc.code, as_json, "terminated")
        except BrokenPipeError:  # stdout's reader went away (`normconv inspect --json | head -1`): not a bug
            reader_gone()
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug in normconv, not the user's mistake: say so, trace on request
            if os.environ.get("NORMCONV_DEBUG"):
                traceback.print_exc()
            fail(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                 f"(set NORMCONV_DEBUG=1 for the traceback)", EXIT_INTERNAL, as_json, "internal")

    return wrapper


__all__ = ["Terminated", "EXIT_BAD_INPUT", "EXIT_READER_GONE", "reader_gone", "KeepNormconvOpt", "OverwriteOpt", "StaticOpt",
           "EXIT_INTERNAL", "user_errors", "emit", "report_stdout", "load_from_flags", "load_half_target", "fail", "options_from_flags", "is_onnx", "refuse_flags", "ConstantInitializersOpt",
           "show_progress", "progress_wanted", "json_error"]
