"""The report's onnxruntime latency (``export``, ``--repeats N``): a fast model gets its N timed runs; a slow one stops
at three once the runs have taken ``REPORT_BUDGET_S`` (MViT's export spent 33 s timing a 2.7 s run). Benchmarks,
which pass no budget, get every run they ask for."""

from __future__ import annotations

import time

import pytest

from normconv.onnx.validate import latency_ms


class Session:
    def __init__(self, seconds: float):
        self.seconds, self.runs = seconds, 0

    def run(self, outputs, feed):
        self.runs += 1
        time.sleep(self.seconds)


@pytest.mark.parametrize("seconds, budget, runs", [(0.001, 0.5, 2 + 10), (0.2, 0.1, 1 + 3), (0.2, None, 2 + 10)])
def test_the_report_times_a_slow_model_three_times(seconds, budget, runs):
    session = Session(seconds)
    ms = latency_ms(session, {}, repeats=10, budget_s=budget)
    assert session.runs == runs and ms >= seconds * 1e3 * 0.9
