"""Static evidence from the compiled code (issue 38, item 6; ``subspace_ref_triton.sass``).

The checker first, on small synthetic SASS listings in ``nvdisasm -g -c``'s format (these run
everywhere: no compiler needed). Then the real kernels: every default decode configuration with
16-bit bases compiled for sm_90 as it launches, its main loop measured and held to the budgets
(warp-instructions per token and KV head: int4/int2 <= 10, float/int8 <= 15, pre-RoPE <= 35; no
local memory, float64 or CALL in the loop; code loads >= 8 bytes). Every budget holds (docs/gpu.md,
"Static budgets, fifth pass"), so the budget test runs in CI with the rest; it prints the measured
table either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from subspace_ref_triton import sass

HEADER = """
	code for sm_90a
		Function : k
"""


def _listing(body: str) -> str:
    return HEADER + body


def _ins(addr: int, text: str, line: int | None = None, file: str = "/k.py") -> str:
    out = f'\t//## File "{file}", line {line}\n' if line is not None else ""
    return out + f"        /*{addr:04x}*/                   {text} ;\n"


def _tags(lines: set[int]):
    return lambda path: frozenset(lines) if path == "/k.py" else frozenset()


def _loop_listing(n_body: int, extra: str = "", code_load: str = "LDG.E.128 R4, desc[UR4][R2.64]") -> str:
    """A prologue, a loop of ``n_body`` instructions and ``extra`` (a code load on line 7, the
    back-edge on line 5, the ``for`` line), an exit and the trap loop after it."""
    text = _ins(0x0, "MOV R1, c[0x0][0x28]", 1) + ".L_x_0:\n" + _ins(0x10, code_load, 7)
    addr = 0x20
    for i in range(n_body - 2):
        text += _ins(addr, "FFMA R0, R1, R2, R0" if i % 2 else "HMMA.16816.F32.BF16 R8, R12, R16, R8", 9)
        addr += 0x10
    for line in extra.splitlines():
        text += _ins(addr, line, 9)
        addr += 0x10
    text += _ins(addr, "@P0 BRA `(.L_x_0)", 5)
    addr += 0x10
    return _listing(text + _ins(addr, "EXIT") + ".L_x_1:\n" + _ins(addr + 0x10, "BRA `(.L_x_1)") + _ins(addr + 0x20, "NOP"))


def _stats(listing: str, tokens=32, warps=4, heads=1, resident=4, code_lines=(7,), main_lines=(5,)):
    instrs, labels = sass.parse(listing)
    return sass.loop_stats(instrs, labels, tokens, warps, heads, resident, tagged=_tags(set(code_lines)), main=_tags(set(main_lines)))


def test_parse_reads_opcodes_predicates_labels_and_lines():
    instrs, labels = sass.parse(_loop_listing(4))
    assert labels[".L_x_0"] == 0x10 and labels[".L_x_1"] == instrs[-2].addr
    bra = next(i for i in instrs if i.opcode == "BRA")
    assert bra.text.startswith("@P0") and bra.line == 5 and bra.file == "/k.py"
    ldg = next(i for i in instrs if i.opcode == "LDG")
    assert ldg.mods == ("E", "128") and sass.load_width(ldg) == 16 and ldg.line == 7


def test_loop_is_the_back_edge_span_and_the_trap_loop_is_none():
    instrs, labels = sass.parse(_loop_listing(10))
    assert sass.loops(instrs, labels) == [(0x10, 0x10 + 9 * 0x10)]  # the trap loop after EXIT is none
    assert len(sass.main_loop(instrs, labels, _tags({5}))) == 10  # the back-edge included


def test_per_token_head_divides_by_tokens_and_heads_and_counts_warps():
    s = _stats(_loop_listing(80))
    assert s.instructions == 80 and s.per_token_head == 80 * 4 / 32
    assert _stats(_loop_listing(80), tokens=64, warps=1, heads=2).per_token_head == 80 / 128


def test_within_budget_passes_and_every_rule_fails_on_its_own():
    ok = _stats(_loop_listing(80))  # 10 per token and KV head: on the budget
    assert sass.violations(ok, "int4") == [] and sass.violations(ok.as_dict(), "float") == []
    assert sass.violations(_stats(_loop_listing(96)), "int4") == ["12.0 warp-instructions per token and KV head > 10"]
    assert sass.violations(_stats(_loop_listing(96)), "float") == []
    for extra, what in (("STL [R1], R0", "1 local loads/stores"), ("LDL R0, [R1]", "1 local loads/stores"), ("DFMA R0, R2, R4, R0", "1 float64"),
                        ("F2F.F64.F32 R2, R0", "1 float64"), ("CALL.REL.NOINC `(__internal_0)", "1 calls")):
        v = sass.violations(_stats(_loop_listing(40, extra)), "float")
        assert len(v) == 1 and v[0].startswith(what), (extra, v)


def test_code_loads_by_line_and_width():
    narrow = _stats(_loop_listing(40, code_load="LDG.E.U8 R4, desc[UR4][R2.64]"))
    assert narrow.code_load_widths == {1: 1}
    assert sass.violations(narrow, "int4") == ["code loads narrower than 8 B: 1 x 1 B"]
    assert _stats(_loop_listing(40, code_load="LDG.E.64 R4, desc[UR4][R2.64]")).code_load_widths == {8: 1}
    assert _stats(_loop_listing(40, code_load="LDGSTS.E.BYPASS.LTC128B.128 [R5], desc[UR4][R2.64]")).code_load_widths == {16: 1}
    # a load on an untagged line is no code load; a loop without one is flagged
    untagged = _stats(_loop_listing(40), code_lines=())
    assert untagged.load_widths == {16: 1} and untagged.code_load_widths == {}
    assert sass.violations(untagged, "float")[0].startswith("no code load found")


def test_bytes_in_flight_model():
    s = _stats(_loop_listing(40, "LDG.E R6, desc[UR4][R2.64]\nLDG.E.U16 R7, desc[UR4][R2.64]"), warps=4, resident=3)
    assert s.load_widths == {2: 1, 4: 1, 16: 1}
    assert s.bytes_per_warp == 32 * (16 + 4 + 2) and s.in_flight_per_sm == 32 * 22 * 4 * 3


def test_main_loop_prefers_the_tagged_loop_over_a_larger_one():
    """Two innermost loops: the untagged one (a tail loop) is larger; the tagged one is measured."""
    text = ".L_x_0:\n" + _ins(0x0, "FADD R0, R0, R1", 5) + _ins(0x10, "@P0 BRA `(.L_x_0)", 5) + ".L_x_1:\n"
    for k in range(6):
        text += _ins(0x20 + 0x10 * k, "FFMA R0, R1, R2, R0", 11)
    text += _ins(0x80, "@P1 BRA `(.L_x_1)", 11) + _ins(0x90, "EXIT")
    instrs, labels = sass.parse(_listing(text))
    assert len(sass.main_loop(instrs, labels, _tags({5}))) == 2
    assert len(sass.main_loop(instrs, labels, _tags(set()))) == 7  # nothing tagged: the largest


def test_nested_loops_measure_the_inner_one():
    text = ".L_x_0:\n" + _ins(0x0, "IADD3 R0, R0, 1, RZ", 3) + ".L_x_1:\n" + _ins(0x10, "FFMA R0, R1, R2, R0", 5) + _ins(0x20, "@P0 BRA `(.L_x_1)", 5)
    text += _ins(0x30, "@P1 BRA `(.L_x_0)", 3) + _ins(0x40, "EXIT")
    instrs, labels = sass.parse(_listing(text))
    assert [i.addr for i in sass.main_loop(instrs, labels, _tags({3, 5}))] == [0x10, 0x20]


def test_budget_kinds():
    assert sass.budget_kind("decode split", "bf16 int4 d=128 r=32 g=4 bt=32 w=4") == "int4"
    assert sass.budget_kind("decode split (graph)", "fp16 d=128 r=32 g=4 bt=32 w=4") == "float"
    assert sass.budget_kind("decode rope", "bf16 int8 d=128 r=32 g=4 bt=32 w=4") == "rope"
    assert sass.budget_kind("decode rope (graph)", "bf16 int4 d=128 r=32 g=4 bt=64 w=4") == "rope"
    assert sass.budget_kind("decode rope (graph)", "fp32 d=128 r=32 g=4 bt=32 w=4") is None
    assert sass.budget_kind("decode split", "fp32 int4 d=128 r=32 g=4 bt=64 w=8") is None
    assert sass.budget_kind("decode merge", "bf16 d_v=128") is None


# ------------------------------------------------------------------------------------- the kernels

SCRIPT = r"""
import json
from subspace_ref_triton import gpu_report
print("RESULTS " + json.dumps(gpu_report.sass_rows()))
"""


def _compiler_reason() -> str | None:
    try:
        from subspace_ref_triton.compile_report import triton_ptxas

        return None if os.path.exists(triton_ptxas(90)) and os.path.exists(sass.nvdisasm()) else "Triton's bundled ptxas/nvdisasm is missing"
    except Exception as err:  # noqa: BLE001 - a Triton without the NVIDIA backend
        return f"Triton's NVIDIA backend is not usable here ({type(err).__name__}: {err})"


@pytest.fixture(scope="module")
def sass_rows():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    reason = _compiler_reason()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULTS ")).removeprefix("RESULTS "))


def test_every_default_decode_configuration_has_a_measured_main_loop(sass_rows):
    """Runs in CI: the measurement itself works on every default decode kernel (a main loop with
    code loads found, figures finite), whatever the budgets say."""
    kinds = {sass.budget_kind(r["kernel"], r["config"]) for r in sass_rows}
    assert {"float", "int8", "int4", "int2", "rope"} <= kinds
    for r in sass_rows:
        s = r["sass"]
        assert s["instructions"] > 0 and s["per_token_head"] > 0 and s["code_load_widths"], (r["kernel"], r["config"])
    print("\n" + sass.table(sass_rows))


def test_default_decode_configurations_meet_the_static_budgets(sass_rows):
    """Issue 38 item 6: a default configuration that breaks a budget fails CI (docs/gpu.md, "Static budgets")."""
    print("\n" + sass.table(sass_rows))
    broken = [f"{r['kernel']} [{r['config']}]: " + "; ".join(v) for r in sass_rows if r["budget"] and (v := sass.violations(r["sass"], r["budget"]))]
    assert not broken, "static budgets broken:\n" + "\n".join(broken)
