"""The GPU's clocks and power through a decode window, sampled by ``nvidia-smi`` beside it.

A long decode window can run into the board's power limit: the driver then lowers the SM
clocks for a while, and the steps in that stretch take longer (session 45: vanilla and
OmniKV at batch 6, 128K, drew 673-710 W against a 700 W limit, clock-event reason "SW
power cap", SM clocks down to 1125 MHz; results/power_cap_s45_h200.csv). The median step
hides such stretches, the mean does not, so each window's record says what the clocks did.

``ClockSampler`` runs ``nvidia-smi --query-gpu=... -lms N`` for the GPU the engine uses and
stamps every line with ``time.perf_counter()`` as it arrives (the clock the window is
timed with); ``summary(t0, t1)`` reduces the samples inside a window. Sampling beside the
window did not visibly move it (session 45, the same b=6 profiles without and with
``nvidia-smi -lms 50`` running: OmniKV 8.371 / 8.391 ms, vanilla 28.310 / 28.326, within
the run-to-run spread); ``task.sample_clocks=false`` turns it off. Where there is no
``nvidia-smi`` (a CPU machine) or it prints nothing usable, the summary is None and the
record's fields are empty: never a guess.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, fields

QUERY = "clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # NVML's clock-event reason bits (nvmlClocksEventReason*)
HW_POWER_BRAKE = 0x80
POWER_REASONS = SW_POWER_CAP | HW_POWER_BRAKE


@dataclass(frozen=True)
class ClockSample:
    t: float  # time.perf_counter() when the line arrived
    sm_mhz: float
    mem_mhz: float
    power_w: float | None  # None where the board does not report it
    reasons: int


@dataclass(frozen=True)
class ClockSummary:
    clock_samples: int
    sm_mhz_min: float
    sm_mhz_mean: float
    mem_mhz_min: float
    power_w_mean: float | None
    power_w_max: float | None
    power_capped_share: float  # of the samples, those with a power reason (SW cap or HW brake) active
    clock_event_reasons: str  # every reason seen in the window, OR-ed, as hex


FIELDS = tuple(f.name for f in fields(ClockSummary))  # a record's decode/bs<B>/gpu_<field>


def parse_line(line: str, t: float) -> ClockSample | None:
    """One ``--format=csv,noheader,nounits`` line of QUERY -> a sample (None if malformed)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        sm, mem = float(parts[0]), float(parts[1])
        reasons = int(parts[3], 16)
    except ValueError:
        return None
    try:
        power = float(parts[2])
    except ValueError:  # "[N/A]"
        power = None
    return ClockSample(t, sm, mem, power, reasons)


def summarize(samples: list[ClockSample], t0: float, t1: float) -> ClockSummary | None:
    """The samples that arrived in ``[t0, t1]``, reduced (None if there are none)."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    if not inside:
        return None
    power = [s.power_w for s in inside if s.power_w is not None]
    seen = 0
    for s in inside:
        seen |= s.reasons
    return ClockSummary(
        clock_samples=len(inside), sm_mhz_min=min(s.sm_mhz for s in inside),
        sm_mhz_mean=sum(s.sm_mhz for s in inside) / len(inside), mem_mhz_min=min(s.mem_mhz for s in inside),
        power_w_mean=sum(power) / len(power) if power else None, power_w_max=max(power) if power else None,
        power_capped_share=sum(bool(s.reasons & POWER_REASONS) for s in inside) / len(inside),
        clock_event_reasons=hex(seen))


def gpu_selector(device) -> str | None:
    """``nvidia-smi -i``'s name for a torch CUDA device: its UUID (CUDA_VISIBLE_DEVICES may
    renumber devices; the UUID does not), None for a CPU device."""
    import os

    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError):  # no UUID from this torch: the index, where it is nvidia-smi's too
        return None if os.environ.get("CUDA_VISIBLE_DEVICES") else str(index)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class ClockSampler:
    """``with ClockSampler(selector) as clocks: ...`` then ``clocks.summary(t0, t1)``.
    ``selector`` None (or no ``nvidia-smi``): samples nothing."""

    def __init__(self, selector: str | None, interval_ms: int = 50, smi: str | None = None) -> None:
        if interval_ms < 1:
            raise ValueError(f"interval_ms must be >= 1, got {interval_ms}")
        self.selector, self.interval_ms = selector, interval_ms
        self.smi = smi if smi is not None else shutil.which("nvidia-smi")
        self.samples: list[ClockSample] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        return [self.smi, "-i", self.selector, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                "-lms", str(self.interval_ms)]

    def _read(self, stream) -> None:
        for line in stream:
            sample = parse_line(line, time.perf_counter())
            if sample is not None:
                self.samples.append(sample)

    def __enter__(self) -> "ClockSampler":
        if self.selector is None or self.smi is None:
            return self
        try:
            self._proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                          bufsize=1)
        except OSError:
            self._proc = None
            return self
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)

    def summary(self, t0: float, t1: float) -> ClockSummary | None:
        return summarize(list(self.samples), t0, t1)
