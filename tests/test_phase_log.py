"""``$NORMCONV_PHASE_LOG``: each phase mark appended to the file as one JSON line (wall clock, phase, resident set),
in the order the command meets them; what benchmarks/phase_profile.py reads. Off (no file) unless set; a path that
exists (the model itself, a link) is never written."""

from __future__ import annotations

import json
import sys

import normconv
from normconv import quiet
from normconv.models import get


def test_each_mark_is_a_json_line_in_order(tmp_path, monkeypatch):
    log = tmp_path / "phases.jsonl"
    monkeypatch.setattr(quiet, "_PHASE_LOG", str(log))
    monkeypatch.setattr(quiet, "_LOG", [])
    z = get("resnet")
    _, report = normconv.fold(z.build().eval(), z.example_inputs())
    assert report.passed
    quiet._LOG[0].close()
    marks = [json.loads(line) for line in log.read_text().splitlines()]
    names = [m["phase"] for m in marks]
    assert names.index("verify") < names.index("capture") < names.index("rewrite") < len(names) - 1
    assert names[-1] == "verify" and [m["step"] for m in marks if m["phase"] == "verify"][-2:] == [1, 2]
    assert all(m["t"] <= n["t"] for m, n in zip(marks, marks[1:]))
    if sys.platform.startswith("linux"):
        assert all(0 < m["vmrss"] <= m["vmhwm"] for m in marks)


def test_nothing_is_written_unless_set(tmp_path, monkeypatch):
    monkeypatch.setattr(quiet, "_PHASE_LOG", None)
    monkeypatch.chdir(tmp_path)
    quiet.phase("load")
    assert list(tmp_path.iterdir()) == []


def test_a_path_that_exists_is_never_written(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model.pt"
    model.write_bytes(b"the user's model")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")  # a dangling link: writing through it would create its target
    for path in (model, link):
        monkeypatch.setattr(quiet, "_PHASE_LOG", str(path))
        monkeypatch.setattr(quiet, "_LOG", [])
        quiet.phase("load")
        quiet.phase("capture")
        assert quiet._PHASE_LOG is None  # said once, then off
    assert model.read_bytes() == b"the user's model" and not (tmp_path / "elsewhere").exists()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("must be a new file" in line for line in err)
