"""The decode-only window's per-step statistics: a pause in one timed step shows as one
slow step and as the window's maximum, not in the median (the engine runs for real on
the CPU; the pause is a sleep added to one step)."""
import time

import pytest

from experiments.throughput import decode_window
from sparseengine import LLM


@pytest.mark.parametrize("pause_at", [None, 3])
def test_a_paused_step_is_one_slow_step(tiny_llama, pause_at) -> None:
    folder, _ = tiny_llama
    with LLM(str(folder), device="cpu", dtype="float32", max_model_len=256) as llm:
        steps, real = [], llm.step

        def step():
            steps.append(None)
            done = real()
            if pause_at is not None and len(steps) == pause_at + 4:  # a timed step: after prefill and warm-up
                time.sleep(0.25)
            return done

        llm.step = step
        prompts = [[3 + i + j for j in range(20)] for i in range(2)]
        w = decode_window.measure(llm, prompts, output_len=16, warmup_steps=2, timed_steps=8)
    assert w.timed_steps == 8 and w.pure_decode_steps >= 10
    assert w.clocks is None  # a CPU: nothing to sample, nothing guessed
    assert 0 < w.step_s_median <= w.step_s_max
    assert w.step_s == pytest.approx(w.window_s / 8)
    if pause_at is None:
        assert w.step_s_max < 0.25
    else:
        assert w.slow_steps >= 1 and w.step_s_max >= 0.25
        assert w.step_s_median < 0.25 and w.step_s > w.step_s_median
