"""`gpu_clocks`: nvidia-smi's lines parsed, a window's samples reduced, and the sampler run
against a stand-in for nvidia-smi (a script printing lines as the real one does, with
nounits; the lines below are from session 45's H200 samples, results/power_cap_s45_h200.csv)."""
import stat
import sys
import time

import pytest

from experiments.throughput import gpu_clocks as G


def test_parse_line():
    s = G.parse_line("1455, 3201, 699.65, 0x0000000000000004\n", 2.5)
    assert s == G.ClockSample(2.5, 1455.0, 3201.0, 699.65, 0x4)
    assert G.parse_line("1980, 3201, [N/A], 0x0000000000000000", 0.0).power_w is None
    for bad in ("", "1980, 3201, 82.2", "No devices were found", "1980, 3201, 82.2, busy"):
        assert G.parse_line(bad, 0.0) is None


def test_summarize_takes_the_window_only():
    samples = [G.ClockSample(t, sm, 3201.0, w, r) for t, sm, w, r in [
        (0.5, 345, 82.0, 0x1),  # before the window: idle
        (1.0, 1980, 390.0, 0x0), (1.2, 1545, 691.0, 0x4), (1.4, 1800, None, 0x80), (1.6, 1980, 600.0, 0x0),
        (2.5, 1125, 709.0, 0x4)]]  # after it
    got = G.summarize(samples, 1.0, 1.6)
    assert got.clock_samples == 4 and got.sm_mhz_min == 1545 and got.sm_mhz_mean == pytest.approx(7305 / 4)
    assert got.power_w_mean == pytest.approx(1681 / 3) and got.power_w_max == 691.0
    assert got.power_capped_share == 0.5 and got.clock_event_reasons == "0x84" and got.mem_mhz_min == 3201
    assert G.summarize(samples, 3.0, 4.0) is None
    assert set(G.FIELDS) == {"clock_samples", "sm_mhz_min", "sm_mhz_mean", "mem_mhz_min", "power_w_mean",
                             "power_w_max", "power_capped_share", "clock_event_reasons"}


def _fake_smi(tmp_path, lines, gap_s):
    """An executable that logs its arguments and prints `lines` `gap_s` apart, then waits
    to be stopped (nvidia-smi -lms runs until it is)."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!{sys.executable}
import sys, time
open({str(tmp_path / 'args')!r}, 'w').write(' '.join(sys.argv[1:]))
for line in {lines!r}:
    print(line, flush=True)
    time.sleep({gap_s})
time.sleep(60)
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_sampler_stamps_lines_as_they_arrive(tmp_path):
    lines = ["1980, 3201, 390.5, 0x0000000000000000", "garbage", "1545, 3201, 691.0, 0x0000000000000004",
             "1800, 3201, 700.3, 0x0000000000000004"]
    smi = _fake_smi(tmp_path, lines, 0.2)
    t0 = time.perf_counter()
    with G.ClockSampler("GPU-1234", interval_ms=100, smi=smi) as clocks:
        deadline = time.perf_counter() + 30
        while len(clocks.samples) < 3 and time.perf_counter() < deadline:
            time.sleep(0.05)
    t1 = time.perf_counter()
    args = (tmp_path / "args").read_text().split()
    assert args[:2] == ["-i", "GPU-1234"] and f"--query-gpu={G.QUERY}" in args and args[-2:] == ["-lms", "100"]
    assert [s.sm_mhz for s in clocks.samples] == [1980, 1545, 1800]  # the garbage line dropped
    ts = [s.t for s in clocks.samples]
    assert t0 < ts[0] < ts[1] < ts[2] < t1 and ts[2] - ts[0] >= 0.3  # stamped as they came, 0.2 s apart
    got = clocks.summary(ts[1], t1)
    assert got.clock_samples == 2 and got.power_capped_share == 1.0 and got.clock_event_reasons == "0x4"


def test_sampler_without_a_gpu_or_nvidia_smi(tmp_path):
    with G.ClockSampler(None, smi=_fake_smi(tmp_path, ["1980, 3201, 82.0, 0x0"], 0.0)) as clocks:
        time.sleep(0.1)
    assert clocks.samples == [] and clocks.summary(0.0, 1e12) is None and not (tmp_path / "args").exists()
    with G.ClockSampler("GPU-1234", smi=str(tmp_path / "missing")) as clocks:
        pass
    assert clocks.summary(0.0, 1e12) is None
    assert G.gpu_selector("cpu") is None
    with pytest.raises(ValueError, match="interval_ms must be >= 1, got 0"):
        G.ClockSampler("GPU-1234", interval_ms=0)
