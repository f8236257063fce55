"""How many programs (thread blocks) of a compiled kernel are resident on one SM, and the split
count that fills the device in whole waves. Plain Python: used by the decode launch on a GPU
(with the compiled kernel's registers and shared memory) and by the offline compile report
(``subspace_ref_triton.gpu_report``, with ptxas's figures), so both size grids the same way.

The limits are those of the CUDA occupancy calculator (CUDA C++ Programming Guide, "Compute
Capabilities", table of technical specifications): registers are allocated per warp in units of
256, shared memory per block in units of 128 bytes plus 1 KiB the runtime reserves per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REG_UNIT = 256  # registers are allocated per warp in multiples of this
SMEM_UNIT = 128  # bytes
SMEM_RESERVED_PER_BLOCK = 1024  # bytes the CUDA runtime reserves per resident block (sm_80+)


@dataclass(frozen=True)
class GPU:
    """One device model: ``arch`` the compute capability as an int (80, 90), ``sms`` its SM count."""

    name: str
    arch: int
    sms: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    bandwidth: float = 3.35e12  # bytes/s of HBM, the vendor's figure (the roofline's memory roof)
    flops: float = 67e12  # FP32 non-tensor FLOP/s (the softmax and the float32 FMAs)


H100 = GPU("H100 SXM", 90, 132, smem_per_sm=228 * 1024, bandwidth=3.35e12, flops=67e12)
A100 = GPU("A100 SXM", 80, 108, smem_per_sm=164 * 1024, bandwidth=2.04e12, flops=19.5e12)
GPUS = (H100, A100)


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limiter: str  # "registers", "shared memory", "warps" or "blocks"

    def waves(self, programs: int, sms: int) -> float:
        """Programs / (resident programs on the whole device): 1.0 is one full wave."""
        return programs / max(self.blocks_per_sm * sms, 1)


def resident_blocks(gpu: GPU, regs_per_thread: int, num_warps: int, shared_bytes: int) -> Occupancy:
    """Resident blocks per SM of a kernel using ``regs_per_thread`` registers, ``num_warps`` warps
    per block and ``shared_bytes`` of shared memory per block (static + dynamic)."""
    regs_per_warp = math.ceil(max(regs_per_thread, 1) * 32 / REG_UNIT) * REG_UNIT
    limits = {
        "registers": (gpu.regs_per_sm // regs_per_warp) // num_warps,
        "warps": gpu.max_warps_per_sm // num_warps,
        "blocks": gpu.max_blocks_per_sm,
    }
    smem = math.ceil(shared_bytes / SMEM_UNIT) * SMEM_UNIT + SMEM_RESERVED_PER_BLOCK
    limits["shared memory"] = gpu.smem_per_sm // smem
    limiter = min(limits, key=limits.get)
    return Occupancy(max(limits[limiter], 0), limiter)


def full_wave_splits(programs: int, num_tokens: int, resident: int, sms: int, min_split: int) -> int:
    """Splits S of the token axis so that ``programs`` x S programs fill the device's resident
    slots (``resident`` per SM) once: flash-decoding's one query over a long cache then keeps
    every SM busy, and no second, partly empty wave runs. No split shorter than ``min_split``
    tokens (the per-split query projection, partial write and merge would dominate)."""
    slots = max(resident, 1) * sms
    return max(1, min(slots // max(programs, 1), math.ceil(num_tokens / max(min_split, 1))))
