"""k3jax.tools.kernel_sass on hand-written nvdisasm text: the K-step loop is the
smallest loop holding an HGMMA, nested loops count their trips (an immediate
counter, or ptxas's two-pass uniform flag), out-of-line retry code and
NOT_DEQUANT opcodes are not counted."""

from __future__ import annotations

import pytest

from k3jax.tools import kernel_sass


def _sass(lines: list[str]) -> str:
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)


ROW_MAJOR_HGMMAS = ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24",
                    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24, gsb0")


def _kernel(inner: list[str], before_inner: list[str],
            hgmmas: tuple[str, ...] = ROW_MAJOR_HGMMAS) -> str:
    return _sass([
        "IMAD.MOV.U32 R1, RZ, RZ, RZ",
        ".L_x_1:",                                    # the tile loop
        ".L_x_2:",                                    # the K-step loop
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R9+URZ], R8",
        "@!P2 BRA `(.L_x_9)",                         # retry, out of line
        *before_inner,
        ".L_x_3:",
        *inner,
        "BAR.SYNC.DEFER_BLOCKING R12, 0x80",
        "FENCE.VIEW.ASYNC.S",
        "WARPGROUP.ARRIVE",
        *hgmmas,
        "IADD3 R138, R138, 0x1, RZ",
        "ISETP.NE.U32.AND P2, PT, R138, 0x18, PT",
        "@P2 BRA `(.L_x_2)",
        "ISETP.NE.U32.AND P1, PT, R1, 0x9, PT",
        "@P1 BRA `(.L_x_1)",
        "EXIT",
        ".L_x_9:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R9+URZ], R8",
        "@!P2 BRA `(.L_x_9)",
        "BRA `(.L_x_2)",
    ])


def test_counter_loop_counts_its_trips():
    inner = ["LDS.U16 R89, [R90]", "LOP3.LUT R2, R89, 0xf, RZ, 0xc0, !PT", "FMUL R3, R2, R4",
             "VIADD R120, R120, 0x20", "ISETP.NE.U32.AND P3, PT, R120, 0x80, PT",
             "@P3 BRA `(.L_x_3)"]
    step = kernel_sass.k_step_count(_kernel(inner, ["IMAD.MOV.U32 R120, RZ, RZ, RZ"]))
    assert step.nested_trips == (4,)
    # per K step: the init + the loop's 6 x 4 + the K loop's retry branch,
    # IADD3, ISETP and back edge (the retry code itself is out of the loop)
    assert step.instructions == 1 + 6 * 4 + 4
    assert step.mma_weights == 2 * 128 * 16
    assert dict(step.by_opcode)["FMUL"] == 4
    assert step.per_weight() == pytest.approx(29 * 128 / 4096)
    assert step.per_weight(planes=2) == pytest.approx(2 * 29 * 128 / 4096)


def test_register_a_hgmma_counts_its_m_by_k_weights():
    """The swap-AB kernel's HGMMA takes the dequantized weights as A from
    registers (m x k of them), the x tile as B (n = 8 tokens here)."""
    hgmmas = ("HGMMA.64x8x16.F32.BF16 R24, R28, gdesc[UR8], R24",
              "HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR8], R24, gsb0")
    step = kernel_sass.k_step_count(_kernel(["HMUL2.BF16_V2 R5, R6, R7"], [], hgmmas))
    assert step.mma_weights == 2 * 64 * 16
    assert step.per_weight() == pytest.approx(step.instructions * 128 / 2048)


def test_two_pass_flag_loop_counts_two():
    inner = ["PRMT R5, R6, 0x5410, R7", "PLOP3.LUT P3, PT, PT, PT, UP0, 0x80, 0x0",
             "UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x40, 0x0", "@P3 BRA `(.L_x_3)"]
    step = kernel_sass.k_step_count(
        _kernel(inner, ["UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x80, 0x0"]))
    assert step.nested_trips == (2,)
    assert step.instructions == 1 + 4 * 2 + 4


def test_two_pass_predicate_flag_loop_counts_two():
    """The same two-pass loop on a predicate register: P0 set true before,
    copied into the back edge's P5, then set false."""
    inner = ["PRMT R5, R6, 0x5410, R7", "PLOP3.LUT P5, PT, P0, PT, PT, 0x80, 0x0",
             "PLOP3.LUT P0, PT, PT, PT, PT, 0x8, 0x0", "@P5 BRA `(.L_x_3)"]
    step = kernel_sass.k_step_count(_kernel(inner, ["PLOP3.LUT P0, PT, PT, PT, PT, 0x80, 0x0"]))
    assert step.nested_trips == (2,)


def test_fast_path_skips_a_branched_over_block():
    """A block the K step can branch around (no HGMMA / HMUL2 in it) is not
    on the fast path; loop_instructions still counts it."""
    sass = _sass([
        ".L_x_2:",
        "HMUL2.BF16_V2 R1, R2, R3",
        "@P1 BRA `(.L_x_4)",
        "FMUL R5, R5, R6", "FMUL R5, R5, R6", "FMUL R5, R5, R6",
        ".L_x_4:",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24, gsb0",
        "ISETP.NE.U32.AND P2, PT, R138, 0x18, PT",
        "@P2 BRA `(.L_x_2)",
    ])
    step = kernel_sass.k_step_count(sass)
    assert step.instructions == 4 and step.loop_instructions == 7
    assert "FMUL" not in dict(step.by_opcode)


def test_unreadable_trip_count_is_an_error():
    inner = ["ISETP.GE.U32.AND P3, PT, R7, 0x2, PT", "@P3 BRA `(.L_x_3)"]
    with pytest.raises(kernel_sass.SassParseError, match="no counter compare"):
        kernel_sass.k_step_count(_kernel(inner, []))


def test_no_mma_loop_is_an_error():
    with pytest.raises(kernel_sass.SassParseError, match="no loop holds an HGMMA"):
        kernel_sass.k_step_count(_sass([".L_x_1:", "IADD3 R1, R1, 0x1, RZ",
                                        "ISETP.NE.AND P0, PT, R1, 0x4, PT", "@P0 BRA `(.L_x_1)"]))
