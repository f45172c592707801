"""quiet.collector_frozen_at_phases: each phase's first mark freezes what is alive, so that the collections a phase
triggers walk only what it made; on exit everything is unfrozen; a caller's own freeze is left alone. The command
line and the API run each command inside it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import normconv
from normconv.quiet import collector_frozen_at_phases, phase


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def no_freeze():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_each_phase_s_first_mark_freezes_what_is_alive_and_the_end_unfreezes():
    assert gc.get_freeze_count() == 0
    with collector_frozen_at_phases():
        assert gc.get_freeze_count() == 0  # nothing before the first mark
        phase("load")
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the imported libraries, this test's objects
        kept = [_Cycle() for _ in range(100)]
        phase("load", 2, 3)  # the same phase again (a block of a streamed pass): nothing frozen
        assert gc.get_freeze_count() == frozen
        phase("capture")  # a new phase: what the last one made is frozen too
        assert gc.get_freeze_count() >= frozen + 100
    assert gc.get_freeze_count() == 0
    del kept


def test_garbage_cycles_made_within_a_phase_are_collected():
    with collector_frozen_at_phases():
        phase("rewrite")
        c = _Cycle()
        gone = weakref.ref(c)
        del c
        gc.collect()
        assert gone() is None


def test_a_caller_s_own_freeze_and_an_outer_block_are_left_alone():
    gc.freeze()
    theirs = gc.get_freeze_count()
    with collector_frozen_at_phases():
        phase("load")
        assert gc.get_freeze_count() == theirs  # not ours to extend or end
    assert gc.get_freeze_count() == theirs
    gc.unfreeze()
    with collector_frozen_at_phases():
        with collector_frozen_at_phases():
            phase("load")
        assert gc.get_freeze_count() > 0  # the inner block ended nothing: the outer one owns the freeze
    assert gc.get_freeze_count() == 0


def test_the_api_and_the_command_line_run_a_command_inside_it(tmp_path, monkeypatch):
    from normconv.cli import main
    from normconv import quiet

    seen = []
    freeze = gc.freeze
    monkeypatch.setattr(quiet.gc, "freeze", lambda: seen.append(1) or freeze())
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
    folded, report = normconv.fold(model, torch.randn(2, 3, 8, 8))
    assert report.passed and seen and gc.get_freeze_count() == 0
    seen.clear()
    monkeypatch.setattr("sys.argv", ["normconv", "fold", "zoo:resnet", "-o", str(tmp_path / "f.pt")])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None) and seen and gc.get_freeze_count() == 0
    gc.freeze()
    seen.clear()
    normconv.fold(model, torch.randn(2, 3, 8, 8))
    assert not seen and gc.get_freeze_count() > 0  # the caller's freeze: untouched, not extended
