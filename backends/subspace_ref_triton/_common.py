"""Small helpers shared by the kernels and the backend; importing this module imports neither
torch nor triton."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# Largest head size / rank the kernels take: every tile of one program is padded to a power of
# two <= this; beyond, the tiles no longer fit in registers (at 256 the sm_90 build of the
# decode kernel already spills a few hundred bytes per thread).
MAX_HEAD_SIZE = 256
MAX_RANK = 256
# The GQA group is padded to a power of two >= 16 (the tl.dot minimum); beyond this the
# (group x head size) accumulators no longer fit in registers.
MAX_GROUP = 64
DOT_MIN = 16

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is *decorated*, so it has to be set before
    :mod:`subspace_ref_triton.decode` / :mod:`subspace_ref_triton.project` are first imported;
    the backend imports them lazily for that reason.
    """
    # the values Triton's own getenv_bool takes as true
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "y", "on")


def pow2_at_least(n: int, floor: int = DOT_MIN) -> int:
    """The smallest power of two >= max(n, floor): the padded tile size of a dimension."""
    n = max(int(n), floor, 1)
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_device_count(num_tokens, q) -> None:
    """ValueError unless ``num_tokens`` (a launch's device token count) is a one-element int32 or
    int64 tensor on q's device: the kernel reads it through a pointer, which a host tensor is not."""
    import torch  # only launchers call this: torch is there

    if not isinstance(num_tokens, torch.Tensor):
        raise ValueError(f"num_tokens must be a one-element int32 or int64 torch tensor on q's device ({q.device}), got {type(num_tokens).__name__}")
    if num_tokens.dtype not in (torch.int32, torch.int64) or num_tokens.numel() != 1 or num_tokens.device != q.device:
        raise ValueError(f"num_tokens must be a one-element int32 or int64 torch tensor on q's device ({q.device}), "
                         f"got a {str(num_tokens.dtype).removeprefix('torch.')} tensor of shape {tuple(num_tokens.shape)} on {num_tokens.device}")


def dtype_name(dtype) -> str:
    """"float32", "bfloat16", ... for a torch dtype (``str(torch.float32)`` is "torch.float32")."""
    return str(dtype).replace("torch.", "")


@dataclass
class Launch:
    """One kernel launch, built but not run: :meth:`run` launches it; the ahead-of-time compile
    check (``tests/test_triton_compile.py``) compiles exactly these arguments for a GPU target
    on a machine without one."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    # ptxas's register cap per thread (Triton's ``maxnreg``): more resident programs per SM at the
    # cost of spills, where a GPU timed that faster (``decode.launch_config``); None: ptxas chooses.
    max_registers: int | None = None

    def options(self) -> dict:
        """The compile options Triton takes beside the constexprs."""
        options = {"num_warps": self.num_warps}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def run(self):
        return self.kernel[self.grid](*self.args, **self.constexprs, **self.options())
