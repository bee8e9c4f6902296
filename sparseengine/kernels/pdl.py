"""Letting the next kernel launch early: the programmatic dependent launch (PDL) trigger in
a Triton kernel that a `cuda_linear` launch follows.

`cuda_linear` launches as a programmatic dependent launch: its CTAs may start, and load
their first weights, before `griddepcontrol.wait` holds them until the previous kernel's
writes are visible. But they may start only once every program of the previous kernel has
signalled (`griddepcontrol.launch_dependents`) or exited. The split-K merge kernel, which
the attention's output projection follows in every layer, did neither early, so the o
projection started loading only as the merge drained. `pdl_trigger(TRIGGER)` as a kernel's
first statement signals at once.

It is safe in any kernel: the signal only lets a kernel launched with PDL start, and such a
kernel waits (`griddepcontrol.wait`) for this one's completion and writes before it reads
anything but its weights. Launched without PDL, the next kernel starts after this one as
before, and the instruction does nothing. Triton kernels that themselves launched with PDL
and waited first made the step slower (session 8, `merge_tile_pdl_ab_h200.jsonl`), so
only the signal is used here.

`trigger_arg(device)` gives the kernel's `TRIGGER` constexpr: on only on a CUDA GPU of
compute capability 9.0 or newer, not under the interpreter (which has no griddepcontrol),
and while `TRIGGER_NEXT` is on (read at each call: `profile_decode_step.py --kernel-const
pdl.TRIGGER_NEXT=False` sets it for A/Bs).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import shared_helper

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl
    import triton.language.extra.cuda as tlc

TRIGGER_NEXT = True
MIN_CAPABILITY = (9, 0)  # griddepcontrol: sm_90


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def available(device: torch.device | str) -> bool:
    """Whether a Triton kernel on `device` can carry the trigger (the switch aside)."""
    device = torch.device(device)
    if device.type != "cuda" or _common.interpreting():
        return False
    return _capable(torch.cuda.current_device() if device.index is None else device.index)


def trigger_arg(device: torch.device | str) -> bool:
    """The `TRIGGER` constexpr of a kernel that begins with `pdl_trigger(TRIGGER)`."""
    return bool(TRIGGER_NEXT) and available(device)


@shared_helper
def pdl_wait(ON: tl.constexpr):
    """With `ON`, in a kernel launched with PDL: wait until the kernel before has finished
    and its writes are visible; returns an int32 0 that the compiler cannot see through, to
    add to the addresses of what the kernel before writes: a load whose address depends on
    it cannot be issued before the wait (Triton's pipeliner moves a dot operand's load into
    the loop's prologue, ahead of everything else in the loop). Without `ON`, 0."""
    if ON:
        zero = tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        zero = 0
    return zero


@shared_helper
def pdl_trigger(ON: tl.constexpr):
    """With `ON`, let a kernel launched after this one with PDL start now (it still waits
    for this kernel's writes before reading them). Without it, nothing."""
    if ON:
        tlc.gdc_launch_dependents()
