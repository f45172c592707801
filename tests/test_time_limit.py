"""A time limit on a library call normconv cannot stop otherwise (``normconv.io.time_limit``): torch.export's
dynamic-shape reasoning ran past 20 minutes on DaViT-T. Past the limit the export is made with the example's shapes
and the report says so; the limit never escapes as anything but ``Overtime`` and leaves no timer behind."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import torch

from normconv.io import time_limit as tl


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # Python bytecode: where a signal handler runs
        pass


def test_a_block_past_its_limit_ends_as_overtime_even_through_except_exception():
    before = signal.getsignal(signal.SIGALRM)
    assert tl.available()
    t0 = time.perf_counter()
    with pytest.raises(tl.Overtime) as err:
        with tl.time_limit(0.2):
            try:  # a library that takes any Exception for its own failure
                _spin(5)
            except Exception:  # noqa: BLE001
                _spin(5)
    assert time.perf_counter() - t0 < 2 and err.value.seconds == 0.2 and "ran past 0.2 s" in str(err.value)
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    with tl.time_limit(0.5):  # within its limit: nothing happens, then or later
        _spin(0.05)
    _spin(0.6)
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_raise_swallowed_where_python_drops_exceptions_is_not_the_last():
    # a finalizer or a garbage-collector callback prints and drops what is raised in it: the timer fires again
    swallowed = []
    with pytest.raises(tl.Overtime):
        with tl.time_limit(0.1):
            try:
                _spin(5)
            except BaseException as exc:  # noqa: BLE001 - what Python does to an exception raised in a __del__
                swallowed.append(type(exc).__name__)
            _spin(5)
    assert swallowed == ["_Expired"] and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_raise_turned_into_another_error_on_its_way_out_is_still_overtime():
    # C code the raise lands in reports its own error instead (Python's AST constructor: a SystemError), and a
    # library's except Exception would take that for its own failure
    with pytest.raises(tl.Overtime) as err:
        with tl.time_limit(0.1):
            try:
                _spin(5)
            except BaseException as exc:  # noqa: BLE001 - what the C code does with it
                raise SystemError("AST constructor recursion depth mismatch") from exc
    assert isinstance(err.value.__cause__, SystemError) and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    with pytest.raises(ValueError):  # an error of the block's own, within the limit, is left as it is
        with tl.time_limit(5):
            raise ValueError("the library's own failure")


def test_no_raise_inside_an_import(tmp_path, monkeypatch):
    # a module whose import spins past the limit is imported whole; the limit lands after it
    (tmp_path / "slow_module_tl.py").write_text("import time\nend = time.perf_counter() + 0.6\n"
                                                "while time.perf_counter() < end:\n    pass\nDEFINED_LAST = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(tl.Overtime):
        with tl.time_limit(0.1):
            import slow_module_tl
            _spin(5)
    import sys
    assert sys.modules["slow_module_tl"].DEFINED_LAST == 1
    sys.modules.pop("slow_module_tl")


def test_a_callers_timer_is_kept_and_no_limit_off_the_main_thread():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)  # a sweep's limit on the whole command: later than ours
        with pytest.raises(tl.Overtime):
            with tl.time_limit(0.05):
                _spin(2)
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 25 < left <= 30 and fired == []  # set again with what is left of it, its handler back
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # one that ends before ours: left alone, and it fires
        with tl.time_limit(5):
            _spin(0.3)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seen = []

    def other():
        seen.append(tl.available())
        with tl.time_limit(0.05):
            _spin(0.2)
        seen.append("done")

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [False, "done"]


@pytest.fixture
def stuck(monkeypatch):
    """torch.export with dynamic shapes stuck in Python for 5 s first (DaViT-T's sympy), under a 0.3 s limit; static
    exports run as they are. With a real export and a 0.01 s limit the .pt2 test failed in two of three full-suite
    runs and never alone (cause not found; a raise dropped inside torch is one explanation): a stuck export leaves
    the limit no race to lose."""
    from normconv.io import outputs
    from normconv.onnx import export as onnx_export

    real = torch.export.export

    def export(*args, **kwargs):
        if kwargs.get("dynamic_shapes") is not None:
            _spin(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    monkeypatch.setattr(onnx_export, "DYNAMIC_EXPORT_S", 0.3)
    monkeypatch.setattr(outputs, "DYNAMIC_EXPORT_S", 0.3)


def test_export_past_the_limit_writes_the_static_file_and_says_so(cli, tmp_path, stuck):
    import onnxruntime as ort

    out = tmp_path / "gpt.onnx"
    t0 = time.perf_counter()
    code, printed, err = cli("export", "zoo:gpt", "-o", out, "--json")
    assert code == 0, err
    rep = json.loads(printed)
    assert any("dynamic dimensions ran past 0.3 s (--static skips it)" in n for n in rep["notes"]), rep["notes"]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert all(isinstance(d, int) for i in sess.get_inputs() for d in i.shape)  # the example's shapes
    assert rep["passed"] and time.perf_counter() - t0 < 60
    # each dimension the model lets vary says it was the time limit, not a refusal by torch.export
    held = [d for d in rep["extra"]["dynamic_dims"] if d["code"] != "one-size-only"]
    assert held and all(d["code"] == "export-overtime" for d in held), held
    assert all("ran past 0.3 s (--static skips it)" in d["pinned"] for d in held), held


def test_export_past_the_limit_that_no_static_export_takes_says_why(cli, tmp_path, stuck):
    """The dynamic export runs past the limit, then the static one fails on a branch on tensor values (torchvision's
    detectors): the one-line refusal is the static export's reason, not the limit's (it said "ran past 0.3 s", a
    reason no faster machine removes)."""
    out = tmp_path / "m.onnx"
    code, printed, err = cli("export", "tests.fixtures.vision_models:data_dependent_branch", "-o", out,
                             "--accept-specialized", "--json")
    rep = json.loads(printed)
    assert code == 2 and not out.exists() and list(tmp_path.iterdir()) == []
    assert "data-dependent" in rep["error"] and "\n" not in rep["error"], rep["error"]
    assert "ran past 0.3 s" in rep["error"]  # the dynamic export's try is said after the reason


def test_pt2_past_the_limit_is_written_static_and_says_so(cli, tmp_path, stuck):
    from normconv.io.load import load
    from normconv.verify import run

    out = tmp_path / "swapped.pt2"
    code, printed, err = cli("swap", "zoo:gpt", "--to", "rmsnorm", "--approximate", "-o", out, "--json")
    assert code == 0, err
    rep = json.loads(printed)
    assert any("its reasoning about them ran past 0.3 s; --static skips it" in n for n in rep["notes"]), rep["notes"]
    assert any("could not keep them dynamic" in n for n in rep["notes"])
    program = torch.export.load(str(out)).module()
    loaded = load("zoo:gpt")
    got = run(program, loaded.inputs)
    assert torch.isfinite(got if isinstance(got, torch.Tensor) else got[0]).all()


def test_ctrl_c_during_the_export_ends_as_the_interrupt(cli, tmp_path, monkeypatch):
    """A SIGINT landing in torch.export, which wraps it in its own error (an interrupted lazy import of torch._dynamo
    came out as "AttributeError: module 'torch._dynamo' has no attribute 'exc'"), ends the command as interrupted
    (130), the export not tried again; it was exit 2 "cannot export ... to ONNX", a bad input. A library that
    swallows the interrupt ends as it too."""
    calls = []

    def wrapping_export(*a, **k):  # the interrupt lands inside the library, which words it as its own failure
        calls.append(1)
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt as exc:
            raise RuntimeError("Failed to export the model with torch.export") from exc

    monkeypatch.setattr(torch.onnx, "export", wrapping_export)
    code, out, _ = cli("export", "zoo:mlp", "-o", tmp_path / "m.onnx", "--no-baseline", "--json")
    assert (code, json.loads(out)["code"], len(calls)) == (130, "interrupted", 1)
    assert list(tmp_path.iterdir()) == []

    def swallowing(*a, **k):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with tl.interrupt_kept():
            swallowing()
    assert signal.getsignal(signal.SIGINT) is before  # the handler put back
