"""Ahead-of-time compile of the Triton kernels for NVIDIA GPUs (sm_90, sm_80), on any machine, as
they will launch (``subspace_ref_triton.compile_report``: Triton's own launch-time specialisation,
divisibility attributes included), with ptxas's resource figures.

The interpreter (TRITON_INTERPRET=1, what ``test_triton_kernels.py`` runs without a GPU) executes
kernel bodies as Python, so it misses what only the GPU compiler rejects (non-constexpr globals,
tl.dot operand dtypes and shapes, loop-carried type changes) and says nothing about registers.
Here every default configuration of ``subspace-kv gpu-report`` (the launches the backend makes at
the benchmark's shape, every dtype and coefficient storage, eager and graph-capturable) is
compiled once per run in a subprocess (the kernels must be decorated with TRITON_INTERPRET
unset), and the test fails when one of them spills. The exhaustive sweep is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
from dataclasses import asdict
from subspace_ref_triton import gpu_report
rows = gpu_report.triton_rows(exhaustive=sys.argv[1] == "1")
gpu_report.add_occupancy(rows)
print("RESULTS " + json.dumps([asdict(r) for r in rows]))
"""


def _ptxas_reason() -> str | None:
    try:
        from subspace_ref_triton.compile_report import triton_ptxas

        return None if os.path.exists(triton_ptxas(90)) and os.path.exists(triton_ptxas(80)) else "Triton's bundled ptxas is missing"
    except Exception as err:  # noqa: BLE001 - a Triton without the NVIDIA backend
        return f"Triton's NVIDIA backend is not usable here ({type(err).__name__}: {err})"


def _compiled(script: str, *args: str) -> list:
    """What ``script`` prints after RESULTS, run where the kernels compile (TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULTS ")).removeprefix("RESULTS "))


def _report(exhaustive: bool) -> list[dict]:
    return _compiled(SCRIPT, "1" if exhaustive else "0")


@pytest.fixture(scope="module")
def default_rows():
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    return _report(False)


def test_every_default_configuration_compiles_for_sm80_and_sm90(default_rows):
    kernels = {(r["kernel"], r["config"]) for r in default_rows}
    assert {r["arch"] for r in default_rows} == {80, 90}
    assert len(default_rows) == 2 * len(kernels)
    assert {k for k, _ in kernels} == {"decode split", "decode split (graph)", "decode rope", "decode rope (graph)", "decode exact", "decode exact merge (graph)",
                                       "decode merge", "project"}
    print("\n" + "\n".join(f"  {r['kernel']} [{r['config']}] sm_{r['arch']}: {r['registers']} registers, "
                           f"{r['spill_stores']} B spilled, {r['shared']} B shared, {r['resident']} per SM" for r in default_rows))


def test_no_default_configuration_spills(default_rows):
    """Unless its register cap was chosen to trade spills for resident programs
    (gpu_report.chosen_reason, each reason citing the measurement or compile in docs/gpu.md)."""
    spills = [f"{r['kernel']} [{r['config']}] sm_{r['arch']}: {r['spill_stores']}/{r['spill_loads']} B"
              for r in default_rows if r["default"] and (r["spill_stores"] or r["spill_loads"]) and not r["measured"]]
    assert not spills, "default launch configurations spill registers:\n" + "\n".join(spills)
    assert all("docs/gpu.md" in r["measured"] for r in default_rows if r["measured"])


def test_spill_exemptions_follow_the_launchers_caps():
    """An exemption is what a GPU timed: the register cap the split kernel's launcher gave a launch
    (the centred int4/int2 cap with bfloat16 bases, eager and graph-capturable, and launch_config's
    caps), or the int8 one-warp launch left uncapped. Not the two-warp float cap, which must not
    spill, nor other uncapped launches (float16 bases in the centred form, float32 bases, int8 on
    other warps). The pre-RoPE kernel only with its default softmax per warp under its cap (timed),
    not with one softmax a tile, whose cap (rope_decode.MAX_REGISTERS) was chosen from the compiled
    code and must not spill (docs/gpu.md, "Caps timed, and a softmax per warp by default")."""
    import numpy as np

    from subspace_ref.rope import RopeParams
    from subspace_ref_triton import decode, gpu_report, rope_decode

    rope = RopeParams(1.0 / 10000.0 ** (np.arange(64) / 64))

    def reason(kernel, coef, dtype=torch.bfloat16, **kw):
        lay = gpu_report._layout(torch, 512, 128, 32, dtype, coef)
        q = torch.zeros(1, gpu_report.H_KV * 4, 128, dtype=dtype)
        if kernel.endswith("(graph)"):
            kw.update(num_tokens=torch.zeros(1, dtype=torch.int64))
        if kernel.startswith("decode rope"):
            launch = rope_decode.split_launch(q, lay, rope, 0.1, 256, num_splits=2, **kw)[0]
        else:
            launch = decode.split_launch(q, lay, 0.1, 256, 2, **kw)[0]
        return gpu_report.chosen_reason(kernel, launch)

    for kernel in ("decode split", "decode split (graph)"):
        for dtype in (torch.bfloat16, torch.float16):
            assert reason(kernel, "int8", dtype) == decode.INT8_UNCAPPED_MEASURED
            assert not reason(kernel, "int8", dtype, num_warps=2)  # uncapped on other warps: not the timed launch
            assert not reason(kernel, "float", dtype)  # capped at FLOAT16_WARPS_MAX_REGISTERS without a spill
        for coef in ("int4", "int2"):
            assert reason(kernel, coef) == decode.REGISTER_CAPS_MEASURED and not reason(kernel, coef, torch.float16)
        for coef in ("float", "int8", "int4"):
            assert not reason(kernel, coef, torch.float32)
    assert reason("decode split", "int4", block_t=64, num_warps=4) == decode.REGISTER_CAPS_MEASURED  # the per-code path: launch_config's cap
    assert reason("decode split", "float", block_t=32, num_warps=4, max_registers=decode.FLOAT16_MAX_REGISTERS) == decode.REGISTER_CAPS_MEASURED
    for kernel in ("decode rope", "decode rope (graph)"):
        for coef in ("float", "int8", "int4"):
            assert reason(kernel, coef) == rope_decode.WARP_SOFTMAX_MEASURED and not reason(kernel, coef, warp_softmax=False)
            assert not reason(kernel, coef, max_registers=0)  # a softmax per warp uncapped: not the timed launch
    assert decode.launch_config(128, 128, torch.float32, bits=4)["max_registers"] is None


def test_pre_rope_register_cap_only_where_it_compiled_clean():
    """rope_decode.MAX_REGISTERS caps the default launch with bfloat16 bases at head size 128,
    rank 32 and GQA groups up to 4 for float, int8 and int4 sides (docs/gpu.md, "Pre-RoPE kernel,
    three programs per SM"), not int2, float16 bases, partial rotary, other shapes or other
    tiles, and max_registers=0 lifts it."""
    import numpy as np

    from subspace_ref.rope import RopeParams
    from subspace_ref_triton import gpu_report, rope_decode

    def cap(d=128, r=32, dtype=torch.bfloat16, coef="float", group=4, planes=None, **kw):
        planes = planes or d // 2
        rope = RopeParams(1.0 / 10000.0 ** (np.arange(planes) / planes))
        lay = gpu_report._layout(torch, 512, d, r, dtype, coef)
        return rope_decode.split_launch(torch.zeros(1, gpu_report.H_KV * group, d, dtype=dtype), lay, rope, 0.1, 256, **kw)[0].max_registers

    for coef in ("float", "int8", "int4"):
        for group in (4, 1, 2):
            assert cap(group=group, coef=coef) == rope_decode.MAX_REGISTERS, (coef, group)
        assert cap(coef=coef, num_tokens=torch.zeros(1, dtype=torch.int64), num_splits=2) == rope_decode.MAX_REGISTERS, coef
        assert cap(coef=coef, group=8) is None and cap(coef=coef, planes=32) is None
        assert all(cap(coef=coef, r=r) is None for r in (8, 16, 24)), coef
    assert cap(coef="int2") is None
    assert cap(dtype=torch.float16) is None
    assert cap(d=64) is None and cap(r=64) is None
    assert cap(block_t=32) is None and cap(num_warps=8) is None and cap(key_parts=2) is None
    assert cap(max_registers=0) is None and cap(coef="int2", max_registers=96) == 96


def test_split_register_cap_only_where_it_compiled_clean():
    """decode.default_max_registers caps the default one-warp and two-warp launches at head sizes up
    to 128: float on two warps at ranks 32 and GQA groups of 2 to 4; int4/int2 centred with bfloat16
    bases on one warp at ranks 16 or 32 and groups up to 4. Not int8 on one warp (timed fastest
    uncapped), ranks 64, float at rank 16, int4 with a group of 8, float16 bases in the centred
    form, other tiles or warps, and max_registers=0 lifts it (docs/gpu.md, "N in the partial",
    "Rank 16 and groups of 8 under the one-warp cap", "Caps timed, and a softmax per warp by default")."""
    from subspace_ref_triton import decode, gpu_report

    def cap(coef="float", d=128, r=32, group=4, dtype=torch.bfloat16, **kw):
        lay = gpu_report._layout(torch, 512, d, r, dtype, coef)
        return decode.split_launch(torch.zeros(1, gpu_report.H_KV * group, d, dtype=dtype), lay, 0.1, 256, **kw)[0].max_registers

    one, two = decode.CENTRED_MAX_REGISTERS, decode.FLOAT16_WARPS_MAX_REGISTERS
    for dtype in (torch.bfloat16, torch.float16):
        assert cap(dtype=dtype) == two and cap(group=2, dtype=dtype) == two and cap(d=64, dtype=dtype) == two
        assert cap(num_tokens=torch.zeros(1, dtype=torch.int64), num_splits=2, dtype=dtype) == two
        assert all(cap("int8", group=g, dtype=dtype) is None for g in (1, 4, 6, 8, 16))
        assert cap(r=16, dtype=dtype) is None and cap("int8", r=16, dtype=dtype) is None and cap(group=8, dtype=dtype) is None
        assert cap(r=24, dtype=dtype) is None and cap("int8", r=24, dtype=dtype) is None
        for coef in ("float", "int8", "int4"):
            assert cap(coef, r=64, dtype=dtype) is None
        assert cap("int4", group=8, dtype=dtype) is None and cap("int4", r=16, group=8, dtype=dtype) is None
    assert cap(group=1) is None and cap(dtype=torch.float32) is None and cap("int8", dtype=torch.float32) is None
    for coef in ("int4", "int2"):
        assert cap(coef) == one and cap(coef, group=1) == one and cap(coef, d=64) == one
        assert cap(coef, r=16) == one and cap(coef, r=16, group=2, d=64) == one and cap(coef, group=8) is None
        assert cap(coef, dtype=torch.float16) is None and cap(coef, r=16, dtype=torch.float16) is None and cap(coef, tokens_m=False) is None
    assert cap(block_t=32) is None and cap(num_warps=4) is None and cap("int8", num_warps=2) is None
    assert cap(max_registers=0) is None and cap("int8", max_registers=96) == 96
    assert cap("int4", block_t=64, num_warps=4) == decode.QUANTISED_MAX_REGISTERS  # the per-code path keeps launch_config's


SPLIT_CAPPED_SCRIPT = r"""
import json
import torch
from subspace_ref_triton import decode, gpu_report, sass
from subspace_ref_triton.compile_report import launch_resources
out = []
bf16, fp16 = torch.bfloat16, torch.float16
for coef, d, r, group, dtype, graph in (("float", 128, 32, 2, bf16, False), ("float", 64, 32, 4, fp16, True), ("int8", 128, 32, 1, bf16, True),
                                        ("int8", 64, 32, 2, fp16, False), ("int4", 128, 32, 1, bf16, False), ("int2", 64, 32, 2, bf16, True),
                                        ("int8", 128, 32, 8, fp16, True), ("int4", 128, 16, 4, bf16, True), ("int2", 64, 16, 2, bf16, False)):
    lay = gpu_report._layout(torch, 8192, d, r, dtype, coef)
    q = torch.zeros(1, gpu_report.H_KV * group, d, dtype=dtype)
    kw = dict(num_tokens=torch.zeros(1, dtype=torch.int64)) if graph else {}
    launch, _ = decode.split_launch(q, lay, 0.1, 0 if graph else 1024, 8, **kw)
    res = launch_resources(launch, 90)
    out.append(dict(case=f"{coef} d={d} r={r} g={group} {dtype} {'graph' if graph else 'eager'}", coef=coef, cap=launch.max_registers,
                    spills=res.spill_stores + res.spill_loads, local=sass.launch_stats(launch, 90).as_dict()["local"]))
print("RESULTS " + json.dumps(out))
"""


def test_split_register_cap_keeps_local_memory_out_of_the_loop_beyond_the_report():
    """The split kernel's defaults at shapes the report's (d = 128, r = 32, g = 4) do not compile:
    smaller GQA groups, head size 64, float16 bases graph-capturable, int8 with a group of 8,
    int4/int2 at rank 16. Compiled for sm_90, float and int4/int2 capped, int8 uncapped (its
    spills are ptxas's own): no local memory in the main loop, and no spill at all with float
    coefficients."""
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    rows = _compiled(SPLIT_CAPPED_SCRIPT)
    assert len(rows) == 9 and all(bool(r["cap"]) == (r["coef"] != "int8") for r in rows), rows
    assert not [r for r in rows if r["local"] or (r["coef"] == "float" and r["spills"])], rows


CAPPED_SCRIPT = r"""
import dataclasses
import json
import numpy as np
import torch
from subspace_ref.rope import RopeParams
from subspace_ref_triton import gpu_report, rope_decode, sass
from subspace_ref_triton.compile_report import launch_resources
rope = RopeParams(1.0 / 10000.0 ** (np.arange(64) / 64))
out = []
layouts = {c: gpu_report._layout(torch, 8192, 128, 32, torch.bfloat16, c) for c in ("float", "int8", "int4")}
key, val = layouts["int4"], layouts["int8"]  # int4 keys beside int8 values: a format per side
layouts["int4/int8"] = dataclasses.replace(key, value_coef=val.value_coef, value_format=val.value_format, value_scale=val.value_scale,
                                           value_token_scale=None, value_token_zero=None)
for group, coef in ((1, "float"), (2, "int4"), (1, "int8"), (4, "int4/int8")):
    for graph in ({}, dict(num_tokens=torch.zeros(1, dtype=torch.int64), num_splits=8)):
        q = torch.zeros(1, gpu_report.H_KV * group, 128, dtype=torch.bfloat16)
        for warp_softmax in (False, None):  # one softmax a tile; the default, a softmax per warp
            launch, _ = rope_decode.split_launch(q, layouts[coef], rope, 0.1, 0 if graph else 1024, warp_softmax=warp_softmax, **graph)
            for arch in (90, 80) if warp_softmax is False else (90,):
                res = launch_resources(launch, arch)
                out.append(dict(case=f"g={group} {coef} {'graph' if graph else 'eager'} sm_{arch}", warps=launch.constexprs["WARPS"], cap=launch.max_registers,
                                spills=res.spill_stores + res.spill_loads, local=sass.launch_stats(launch, arch).as_dict()["local"]))
print("RESULTS " + json.dumps(out))
"""


def test_pre_rope_register_cap_does_not_spill_beyond_the_report():
    """The cap's rule admits shapes the report's defaults (uniform formats, g = 4) do not compile:
    smaller GQA groups and a format per side. Compiled capped, eager and graph-capturable: with one
    softmax a tile none spills on sm_90 or sm_80; the default's softmax per warp (timed faster,
    rope_decode.WARP_SOFTMAX_MEASURED) keeps its spills out of the sm_90 main loop."""
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    rows = _compiled(CAPPED_SCRIPT)
    assert len(rows) == 24 and all(r["cap"] for r in rows) and {r["warps"] for r in rows} == {1, 4}, rows
    assert not [r for r in rows if (r["spills"] if r["warps"] == 1 else r["local"])], rows


WARP_SOFTMAX_SCRIPT = r"""
import json
import numpy as np
import torch
from subspace_ref.rope import RopeParams
from subspace_ref_triton import gpu_report, rope_decode, sass
rope = RopeParams(1.0 / 10000.0 ** (np.arange(64) / 64))
out = []
for coef in ("float", "int8", "int4"):
    lay = gpu_report._layout(torch, 8192, 128, 32, torch.bfloat16, coef)
    q = torch.zeros(1, gpu_report.H_KV * 4, 128, dtype=torch.bfloat16)
    for warp_softmax in (False, True):
        stats = sass.launch_stats(rope_decode.split_launch(q, lay, rope, 0.1, 1024, warp_softmax=warp_softmax)[0], 90).as_dict()
        out.append(dict(coef=coef, warp_softmax=warp_softmax, local=stats["local"], barriers=stats["barriers"], per_token=stats["per_token_head"]))
print("RESULTS " + json.dumps(out))
"""


def test_pre_rope_warp_softmax_takes_fewer_barriers():
    """The pre-RoPE kernel's softmax per warp (``warp_softmax``, the default since an H200 timed it
    faster) compiled for sm_90 at the report's shape: fewer barriers in the main loop than one
    softmax a tile (``warp_softmax=False``) (float: no max or transpose across warps, 4 fewer; int8: its keys read per
    code, not decoded from words as a tile that passes through shared memory, 4 fewer; int4: 2 fewer),
    no local memory there, within the instruction budget (docs/gpu.md, "A softmax per warp in the
    pre-RoPE kernel" and "int8 keys read per code with a softmax per warp")."""
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    rows = {(r["coef"], r["warp_softmax"]): r for r in _compiled(WARP_SOFTMAX_SCRIPT)}
    for coef, fewer in (("float", 4), ("int8", 4), ("int4", 2)):
        default, per_warp = rows[coef, False], rows[coef, True]
        assert per_warp["barriers"] <= default["barriers"] - fewer and not per_warp["local"] and per_warp["per_token"] <= 35, (coef, default, per_warp)


def test_the_launch_is_specialised(default_rows):
    """With the divisibility attributes of a real launch the bf16 split kernel at the benchmark's
    shape (float coefficients: 64-token tiles on decode.FLOAT16_WARPS warps, uncapped) needs well
    under the 255 registers of the unspecialised compile, fits >= 2 per SM and spills nothing."""
    from subspace_ref_triton import decode

    config = f"bf16 d=128 r=32 g=4 bt=64 w={decode.FLOAT16_WARPS}"
    row = next(r for r in default_rows if r["kernel"] == "decode split" and r["config"] == config and r["arch"] == 90)
    assert row["registers"] < 240 and row["resident"] >= 2 and row["spill_stores"] == 0


def test_split_count_runs_one_wave(default_rows):
    """The split count from the kernel's occupancy never starts a second, partly empty wave at
    the benchmark's grid (the former 4-programs-per-SM guess ran 1.3-2.2 waves of the kernels
    that fit fewer than 4: the uncapped rows)."""
    waves = [w for r in default_rows for w in (r["waves"] or {}).values()]
    assert waves and all(splits >= 1 and now <= 1.0 for splits, now, _ in waves)
    fewer = [w for r in default_rows if r["resident"] < 4 for w in (r["waves"] or {}).values()]
    assert fewer and all(before > 1.0 for _, _, before in fewer)


@pytest.mark.slow
def test_exhaustive_sweep_compiles():
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    rows = _report(True)
    assert len(rows) > 100


def test_report_flags_default_spills_and_renders():
    """The report's verdict and table from synthetic rows (no compile)."""
    from dataclasses import asdict

    from subspace_ref_triton import gpu_report

    rows = [gpu_report.Row("triton", "decode split", "bf16 d=128 r=32 g=4 bt=32 w=4", True, 90, 146, 0, 0, 0, 13312, 4),
            gpu_report.Row("cuda", "project_append", "subspace::project_append<float, float, 0, 0, 256>", False, 80, 64, 8, 8, 16, 0, 4),
            gpu_report.Row("triton", "project", "fp32", True, 80, 255, 12, 16, 16, 98368, 4)]
    gpu_report.add_occupancy(rows)
    assert rows[0].resident == 3 and rows[0].waves["N=1"][0] == 49
    report = dict(rows=[asdict(r) for r in rows], roofline=gpu_report.roofline_rows(), nvcc_failures=[], skipped=[])
    spills = gpu_report.default_spills(report)
    assert len(spills) == 1 and "project [fp32] sm_80: 12 B" in spills[0]  # the non-default spill is listed, not flagged
    text = gpu_report.markdown(report)
    assert "| 49, 0.99 (1.33) |" in text and "Default configurations that spill: \n- triton project" in text
