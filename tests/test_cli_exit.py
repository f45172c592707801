"""The ``normconv`` script ends the process at once after a command (``normconv.cli.entry``): what it wrote, printed
and registered to run at exit must all be there, and its exit codes mean what they meant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from normconv.io.load import load


def _script(tmp_path, argv: list[str], before: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{before}\nsys.argv = {['normconv', *argv]!r}\nfrom normconv.cli import entry\nentry()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_written_model_and_its_json_report_are_whole(tmp_path):
    out = tmp_path / "folded.pt"
    r = _script(tmp_path, ["fold", "zoo:resnet", "-o", str(out), "--json"])
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # the whole report reached the pipe
    assert report["passed"] and report["output"] == str(out)
    folded = torch.load(out, weights_only=False)
    original = load("zoo:resnet")
    x = torch.randn(3, 3, 40, 40)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), original.model.eval()(x), atol=1e-4, rtol=1e-4)


def test_exit_handlers_run_and_codes_are_kept(tmp_path):
    marker = tmp_path / "ran"
    handler = f"import atexit\natexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))"
    r = _script(tmp_path, ["inspect", "zoo:gpt", "--json"], before=handler)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sites"] and marker.read_text() == "yes"
    marker.unlink()
    bad = _script(tmp_path, ["fold", "zoo:no-such-model"], before=handler)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    assert marker.read_text() == "yes"


def test_a_reader_that_went_away_exits_141_quietly(tmp_path):
    # `normconv fold ... --json | head -c 10`: the output is written, the rest of the report goes nowhere, no
    # "internal error" (it was exit 3 with one), exit 141 as a shell reports a writer's SIGPIPE
    out = tmp_path / "folded.pt"
    p = subprocess.Popen([sys.executable, "-m", "normconv.cli", "fold", "zoo:resnet", "-o", str(out), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert err == "" and out.is_file()
    torch.load(out, weights_only=False)


def test_a_reader_that_went_away_from_a_table_exits_141_too(tmp_path):
    # `normconv fold ... -o x.pt | head -1`: rich's console exits 1 on a broken pipe (1: "the result failed
    # verification; nothing was written", false here); the reader going away is 141 with or without --json
    out = tmp_path / "folded.pt"
    p = subprocess.Popen([sys.executable, "-m", "normconv.cli", "fold", "zoo:mlp", "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert err == "" and out.is_file()


@pytest.mark.parametrize("args", [("swap", "zoo:llama", "--to", "rmsnorm"), ("fold", "no/such/model.pt"),
                                  ("inspect", "zoo:resnet", "--capture", "nonsense")])
def test_json_is_one_object_on_a_refusal_too(cli, args):
    """--json: stdout is one JSON object whatever the exit, a refusal's message, code and exit code included (it
    was empty, and a script parsing stdout crashed on it); stderr keeps its one line."""
    code, out, err = cli(*args, "--json")
    r = json.loads(out)
    assert code == 2 and r["passed"] is False and r["exit_code"] == 2 and r["code"] in ("refused", "bad-input")
    assert r["error"] in err and len(err.strip().splitlines()) == 1


def test_json_of_a_failed_verification_says_its_error_code_and_exit_code(cli, tmp_path):
    """Exit 1 prints the whole report, and its object carries the keys every failure's does (``error``, ``code``,
    ``exit_code``): a script reads one contract whatever the exit (it had ``passed`` only)."""
    out = tmp_path / "s.pt"
    code, stdout, err = cli("swap", "zoo:gpt", "--to", "rmsnorm", "--atol", "1e-12", "--rtol", "0", "-o", out,
                            "--json")
    r = json.loads(stdout)
    assert code == 1 and r["passed"] is False and r["exit_code"] == 1 and r["code"] == "not-verified"
    assert r["error"] in err and "outputs differ beyond tolerance" in r["error"] and r["validation"]
    assert not out.exists()


@pytest.mark.parametrize("args", [("fold", "zoo:resnet", "--atol", "-1"), ("fold", "zoo:resnet", "--bogus"),
                                  ("nocommand",), ("export", "zoo:mlp", "-o", "never.onnx", "--repeats", "-3")])
def test_a_usage_error_is_one_line_and_exit_2(args):
    """A flag or argument click refuses is bad input like any other: one line on stderr naming the --help to read
    (click printed the usage and the error over four lines); no arguments still show the help."""
    r = subprocess.run([sys.executable, "-m", "normconv.cli", *args], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ") and "--help" in r.stderr
    r = subprocess.run([sys.executable, "-m", "normconv.cli"], capture_output=True, text=True)
    assert r.returncode == 2 and "Commands:" in r.stdout + r.stderr


@pytest.mark.parametrize("command", [["fold", "zoo:mlp"], ["export", "zoo:mlp"]])
def test_an_output_path_that_reads_as_a_flag_is_refused(tmp_path, command):
    """`-o --json` (the path left out): one line and exit 2, no file named --json; ./--json is such a file."""
    r = subprocess.run([sys.executable, "-m", "normconv.cli", *command, "-o", "--json"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "./--json" in r.stderr, r
    assert list(tmp_path.iterdir()) == []
    r = subprocess.run([sys.executable, "-m", "normconv.cli", "fold", "zoo:mlp", "-o", "./--json"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "--json").is_file(), r.stderr


def test_a_usage_error_with_json_is_one_object_too():
    r = subprocess.run([sys.executable, "-m", "normconv.cli", "fold", "zoo:resnet", "--atol", "-1", "--json"],
                       capture_output=True, text=True)
    obj = json.loads(r.stdout)
    assert r.returncode == 2 and obj["passed"] is False and obj["code"] == "usage" and obj["exit_code"] == 2
    assert obj["error"] in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_json_keeps_its_contract_for_a_flag_value_numbers_and_write_errors(cli, tmp_path, monkeypatch):
    """--json=1 is asked JSON too (a usage error printed nothing on stdout); a number that is not finite is null,
    never the string "nan" / "inf" where a number is read (each key keeps one type); a failed write is coded
    write-failed, not bad-input."""
    r = subprocess.run([sys.executable, "-m", "normconv.cli", "fold", "zoo:mlp", "--json=1"], capture_output=True,
                       text=True)
    obj = json.loads(r.stdout)
    assert r.returncode == 2 and obj["code"] == "usage" and obj["error"] in r.stderr

    code, out, err = cli("fold", "zoo:mlp", "--atol", "inf", "--json")
    assert code == 0, err
    check = json.loads(out)["validation"][0]
    assert check["atol"] is None and check["scale_tolerance"] is None and check["outputs"][0]["tolerance"] is None
    assert '"nan"' not in out and '"inf"' not in out

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    code, out, err = cli("fold", "zoo:mlp", "-o", tmp_path / "out.pt", "--json")
    obj = json.loads(out)
    assert (code, obj["code"], obj["exit_code"]) == (2, "write-failed", 2) and "no space left" in obj["error"]


@pytest.mark.parametrize("command", [[c, "no/such/model.pt2", "--overwrite"] for c in
                                     ("fold", "export", "swap", "canonicalize", "deepnorm", "rotate")]
                         + [["fold", "no/such/folder", "--stream"],
                            ["recalibrate", "no/such/model.pt2", "--calibration", "no/such/data.pt"]])
def test_an_empty_output_path_is_a_usage_error_before_any_work(tmp_path, command):
    """`-o "$OUT"` with $OUT unset: `-o ""` was the current folder, and with --overwrite normconv tried to exchange
    the current folder with its output (only the kernel's EBUSY on renaming "." stopped it). Refused before the
    model is even looked for: one line, exit 2, one JSON object coded usage, the folder untouched."""
    (tmp_path / "precious.txt").write_text("precious")
    r = subprocess.run([sys.executable, "-m", "normconv.cli", *command, "-o", "", "--json"],
                       capture_output=True, text=True, cwd=tmp_path)
    obj = json.loads(r.stdout)
    assert r.returncode == 2 and obj["code"] == "usage" and obj["exit_code"] == 2, r
    assert "-o is empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_the_python_api_refuses_an_empty_output_path_too(tmp_path):
    from normconv.errors import NormconvError
    from normconv.io.write import check_writable

    with pytest.raises(NormconvError, match="output path is empty"):
        check_writable("", overwrite=True)
