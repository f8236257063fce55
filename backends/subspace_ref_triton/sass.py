"""Static evidence from the compiled code (issue 38, item 6): the main loop of a decode kernel
read from its SASS (``nvdisasm`` of the cubin that :mod:`subspace_ref_triton.compile_report`
builds), measured against instruction budgets. Plain Python over the disassembly text, so the
checker itself is tested on small synthetic listings (``tests/test_sass_budget.py``).

What is measured (docs/gpu.md, "Static budgets"):

* the main loop: an innermost loop (a backward branch to a label at or before it, containing no
  other backward branch) holding code from the source line tagged ``sass: main loop`` (the
  token loop's ``for``), the largest if several (or of all innermost loops if none is tagged);
  the body is every instruction between the label and the branch, NOPs excluded: a static count,
  one pass through every predicated block;
* warp-instructions per token and KV head: body x warps per program / (tokens per iteration x
  KV heads per program);
* in the loop: local loads/stores (LDL/STL, spills), float64 operations, CALLs, barriers;
* the width of every global load in the loop (LDG, LDGSTS: 1, 2, 4, 8 or 16 bytes per thread),
  and of the *code* loads: loads the line info attributes to a source line tagged ``sass: codes``;
* a model of the bytes in flight per SM: one iteration's global loads outstanding per warp
  (sum of width x 32 lanes) x warps per program x resident programs per SM. Little's law asks
  for about bandwidth x latency / SMs (~18 KB per SM on an H100 at ~700 ns).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

# Issue 38 item 6: warp-instructions per token and KV head in the main loop (16-bit bases).
BUDGETS = {"float": 15, "int8": 15, "int4": 10, "int2": 10, "rope": 35}
MIN_CODE_LOAD_BYTES = 8
CODE_TAG = "sass: codes"  # a source line whose loads read coefficient codes (or float coefficients)
MAIN_TAG = "sass: main loop"  # the for line of a kernel's token loop
# Little's law for HBM on an H100: 3.35 TB/s x ~700 ns / 132 SMs.
NEEDED_IN_FLIGHT_PER_SM = 3.35e12 * 700e-9 / 132

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_F64_OPS = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DMMA"}
_GLOBAL_LOADS = {"LDG", "LDGSTS"}
_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str  # "LDG"
    mods: tuple[str, ...]  # ("E", "128")
    text: str  # the whole instruction, predicate included
    file: str = ""
    line: int = 0


def parse(listing: str) -> tuple[list[Instr], dict[str, int]]:
    """Instructions and label addresses of one function's ``nvdisasm -g -c`` listing."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    file, line = "", 0
    for raw in listing.splitlines():
        if m := _LABEL.match(raw):
            pending.append(m.group(1))
        elif m := _LINE.search(raw):
            file, line = m.group(1), int(m.group(2))
        elif m := _INSTR.search(raw):
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            text = m.group(2).strip()
            op = _PRED.sub("", text).split()[0]
            instrs.append(Instr(addr, op.split(".")[0], tuple(op.split(".")[1:]), text, file, line))
    end = (instrs[-1].addr + 16) if instrs else 0
    labels.update({name: end for name in pending})
    return instrs, labels


def loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last address) of every loop: a branch to a label at or before it. A branch to
    itself (the trap loop after EXIT) is no loop."""
    out = []
    for ins in instrs:
        if ins.opcode in ("BRA", "BRX", "JMP") and (m := _TARGET.search(ins.text)):
            start = labels.get(m.group(1))
            if start is not None and start < ins.addr:
                out.append((start, ins.addr))
    return out


def main_loop(instrs: list[Instr], labels: dict[str, int], tagged=None) -> list[Instr]:
    """The body of the main loop (empty: no loop): among the innermost loops, those with an
    instruction from a source line tagged ``sass: main loop`` (the ``for`` line of the token
    loop: its counter and back-edge carry it), else all; of these the one with the most
    instructions."""
    tagged = tagged or _main_lines
    spans = loops(instrs, labels)
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    bodies = [[i for i in instrs if a <= i.addr <= b and i.opcode != "NOP"] for a, b in inner]
    marked = [b for b in bodies if any(i.file and i.line in tagged(i.file) for i in b)]
    return max(marked or bodies, key=len, default=[])


def load_width(ins: Instr) -> int:
    """Bytes per thread of a global load (4 unless a width or a narrow type is named)."""
    return next((_WIDTHS[m] for m in ins.mods if m in _WIDTHS), 4)


def is_f64(ins: Instr) -> bool:
    if ins.opcode in _F64_OPS:
        return True
    if ins.opcode in ("F2F", "I2F", "F2I", "FRND"):
        return "F64" in ins.mods
    return ins.opcode == "MUFU" and any(m.endswith("64H") for m in ins.mods)


@lru_cache(maxsize=None)
def _lines_with(path: str, tag: str) -> frozenset[int]:
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    return frozenset(i + 1 for i, line in enumerate(text.splitlines()) if tag in line)


def _tagged_lines(path: str) -> frozenset[int]:
    return _lines_with(path, CODE_TAG)


def _main_lines(path: str) -> frozenset[int]:
    return _lines_with(path, MAIN_TAG)


def is_code_load(ins: Instr, tagged=_tagged_lines) -> bool:
    return ins.opcode in _GLOBAL_LOADS and bool(ins.file) and ins.line in tagged(ins.file)


@dataclass
class LoopStats:
    instructions: int  # static count of the main loop's body (per warp, per iteration)
    tokens: int  # tokens per iteration
    warps: int  # warps per program
    heads: int  # KV heads per program
    per_token_head: float  # warp-instructions per token and KV head
    local: int  # LDL/STL in the loop
    local_kernel: int  # LDL/STL in the whole kernel
    f64: int  # float64 operations in the loop
    calls: int
    barriers: int  # BAR in the loop
    mma: int  # HMMA/IMMA/HGMMA in the loop
    load_widths: dict[int, int] = field(default_factory=dict)  # bytes per thread -> global loads in the loop
    code_load_widths: dict[int, int] = field(default_factory=dict)
    bytes_per_warp: int = 0  # one iteration's global loads, all 32 lanes
    resident: int = 0  # programs per SM (occupancy)
    in_flight_per_sm: int = 0  # the model: bytes_per_warp x warps x resident

    def as_dict(self) -> dict:
        return asdict(self)


def loop_stats(instrs: list[Instr], labels: dict[str, int], tokens: int, warps: int, heads: int = 1, resident: int = 0, tagged=_tagged_lines,
               main=_main_lines) -> LoopStats:
    body = main_loop(instrs, labels, main)
    loads = [i for i in body if i.opcode in _GLOBAL_LOADS]
    widths: dict[int, int] = {}
    codes: dict[int, int] = {}
    for ins in loads:
        w = load_width(ins)
        widths[w] = widths.get(w, 0) + 1
        if is_code_load(ins, tagged):
            codes[w] = codes.get(w, 0) + 1
    per_warp = 32 * sum(w * n for w, n in widths.items())
    return LoopStats(
        instructions=len(body),
        tokens=tokens,
        warps=warps,
        heads=heads,
        per_token_head=len(body) * warps / (tokens * heads) if body else float("nan"),
        local=sum(i.opcode in ("LDL", "STL") for i in body),
        local_kernel=sum(i.opcode in ("LDL", "STL") for i in instrs),
        f64=sum(is_f64(i) for i in body),
        calls=sum(i.opcode == "CALL" for i in body),
        barriers=sum(i.opcode == "BAR" for i in body),
        mma=sum(i.opcode in ("HMMA", "IMMA", "HGMMA", "IGMMA") for i in body),
        load_widths=dict(sorted(widths.items())),
        code_load_widths=dict(sorted(codes.items())),
        bytes_per_warp=per_warp,
        resident=resident,
        in_flight_per_sm=per_warp * warps * resident,
    )


def budget_kind(kernel: str, config: str) -> str | None:
    """The budget of a report row (BUDGETS key), or None: budgets hold for the decode kernels with
    16-bit bases (the benchmark's); float32 bases are reported, not budgeted."""
    if not kernel.startswith(("decode split", "decode rope")) or config.startswith("fp32"):
        return None
    if kernel.startswith("decode rope"):
        return "rope"
    words = config.split()
    return words[1] if len(words) > 1 and words[1] in BUDGETS else "float"


def violations(stats: LoopStats | dict, kind: str) -> list[str]:
    """What breaks issue 38's item 6 (empty: nothing): the instruction budget of ``kind``, local
    memory, float64 or a CALL in the loop, a code load narrower than MIN_CODE_LOAD_BYTES."""
    s = stats if isinstance(stats, dict) else stats.as_dict()
    out = []
    if not s["instructions"]:
        return ["no loop found"]
    if not s["per_token_head"] <= BUDGETS[kind]:
        out.append(f"{s['per_token_head']:.1f} warp-instructions per token and KV head > {BUDGETS[kind]}")
    for key, what in (("local", "local loads/stores"), ("f64", "float64 operations"), ("calls", "calls")):
        if s[key]:
            out.append(f"{s[key]} {what} in the loop")
    narrow = {int(w): n for w, n in s["code_load_widths"].items() if int(w) < MIN_CODE_LOAD_BYTES}
    if narrow:
        out.append("code loads narrower than 8 B: " + ", ".join(f"{n} x {w} B" for w, n in sorted(narrow.items())))
    if not s["code_load_widths"]:
        out.append("no code load found in the loop (tag the line with 'sass: codes')")
    return out


# ------------------------------------------------------------------------------------- tools


def nvdisasm() -> str:
    """Triton's bundled nvdisasm (beside its ptxas)."""
    from subspace_ref_triton.compile_report import triton_ptxas

    return str(Path(triton_ptxas(90)).with_name("nvdisasm"))


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -g -c``: the code sections with labels and line info."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([nvdisasm(), "-g", "-c", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr[-2000:]}")
    return proc.stdout


def launch_stats(launch, arch: int = 90, resident: int = 0, heads: int = 1) -> LoopStats:
    """:func:`loop_stats` of a Triton launch compiled for sm_<arch> (tokens per iteration: its
    BLOCK_T)."""
    from subspace_ref_triton.compile_report import compile_launch

    instrs, labels = parse(disassemble(compile_launch(launch, arch).asm["cubin"]))
    return loop_stats(instrs, labels, launch.constexprs["BLOCK_T"], launch.num_warps, heads, resident)


def table(rows: list[dict]) -> str:
    """Markdown of :func:`subspace_ref_triton.gpu_report.sass_rows`."""
    lines = ["| kernel | configuration | budget | warp-instr. / token / KV head | loop instr. | tokens | warps | LDL/STL | f64 | CALL | BAR | MMA "
             "| global loads in the loop (B x n) | code loads (B x n) | bytes in flight / SM (model) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, kind = r["sass"], r["budget"]
        widths = ", ".join(f"{w}x{n}" for w, n in s["load_widths"].items())
        codes = ", ".join(f"{w}x{n}" for w, n in s["code_load_widths"].items())
        verdict = "" if not kind else ("ok" if not (v := violations(s, kind)) else "; ".join(v))
        lines.append(f"| {r['kernel']} | {r['config']} | {BUDGETS[kind] if kind else ''} | {s['per_token_head']:.1f} | {s['instructions']} | {s['tokens']} | "
                     f"{s['warps']} | {s['local']} | {s['f64']} | {s['calls']} | {s['barriers']} | {s['mma']} | {widths} | {codes} | "
                     f"{s['in_flight_per_sm']} | {verdict} |")
    lines.append(f"\nBytes in flight per SM that Little's law asks of an H100 (3.35 TB/s x ~700 ns / 132 SMs): ~{NEEDED_IN_FLIGHT_PER_SM / 1e3:.0f} KB.")
    return "\n".join(lines) + "\n"
