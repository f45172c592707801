"""``$NORMCONV_PHASE_LOG``: each phase mark appended to the file as one JSON line (wall clock, phase, resident set),
in the order the command meets them; what benchmarks/phase_profile.py reads. Off (no file) unless set."""

from __future__ import annotations

import json
import sys

import normconv
from normconv import quiet
from normconv.models import get


def test_each_mark_is_a_json_line_in_order(tmp_path, monkeypatch):
    log = tmp_path / "phases.jsonl"
    monkeypatch.setattr(quiet, "_PHASE_LOG", str(log))
    z = get("resnet")
    _, report = normconv.fold(z.build().eval(), z.example_inputs())
    assert report.passed
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
