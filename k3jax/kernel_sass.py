"""SASS instruction counts of a Mosaic GPU kernel's consumer K-step loop
(sm_90a), from the PTX Mosaic dumps: the nvidia-cuda-nvcc wheel's ptxas
builds the cubin, the nvidia-cuda-nvdisasm wheel's nvdisasm disassembles it.

    sass = disassemble(ptx_text, bin_dir)       # nvdisasm -c text
    step = k_step_count(sass)                   # KStepSass
    step.per_weight(planes=1)                   # dequant_sass_per_weight

The K-step loop is the smallest loop (a conditional backward branch) that
holds WGMMAs (HGMMA). Its instructions are counted per thread, once per K
step: a loop nested inside it counts ``trips`` times, the trip count read off
its counter (initialised before the loop, stepped by an immediate, compared
with an immediate by the back edge's ISETP). Out-of-line code the loop jumps
to (barrier try-wait retries) is not counted: it runs only while waiting.

Not counted (NOT_DEQUANT): WGMMA and its fences, TMA, barriers and the
pipeline's own synchronisation (mbarrier SYNCS, BAR, MEMBAR, FENCE, DEPBAR).
Everything else in the loop is charged to the weight dequantization: the
integer / float ALU work, the SMEM loads of the codes and scales, the SMEM
stores of the bf16 tile, the x split and the loop's own bookkeeping.

``dequant_sass_per_weight`` = counted instructions per thread per K step x
128 threads / the weight elements one warpgroup's K step multiplies
(sum of k x n over the step's HGMMAs / x planes).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

WARPGROUP_THREADS = 128

DEQUANT_KERNELS = re.compile(r"grouped_\w+_mxfp4_")
"""Kernel names whose K steps dequantize weights (ptxas_dump counts them)."""

NOT_DEQUANT = ("HGMMA", "WARPGROUP", "UTMA", "UBLKCP", "SYNCS", "BAR", "MEMBAR", "FENCE",
               "DEPBAR", "ERRBAR", "CCTL", "NOP")
"""Opcode prefixes not charged to the dequantization (the module docstring)."""

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"^(@!?U?P\d+\s+)?BRA\s+`?\(?(\.L_x_\d+)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)")


class SassParseError(ValueError):
    """The disassembly has no K-step loop, or a nested loop's trip count
    cannot be read off its counter."""


def disassemble(ptx: str, bin_dir: Path, arch: str = "sm_90a") -> str:
    """PTX text -> ``nvdisasm -c`` of the cubin the wheel's ptxas builds."""
    with tempfile.TemporaryDirectory(prefix="k3jax-sass-") as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        subprocess.run([str(bin_dir / "ptxas"), f"-arch={arch}", "-o", str(cubin), str(src)],
                       check=True, capture_output=True, text=True)
        out = subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)], check=True,
                             capture_output=True, text=True)
    return out.stdout


def opcode(instruction: str) -> str:
    """``@P2 IADD3.X R1, ...`` -> ``IADD3.X``."""
    parts = instruction.split()
    return parts[1] if parts[0].startswith("@") else parts[0]


def parse(sass: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm text -> (instructions in address order, label -> index)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := _INSTRUCTION.match(line):
            instructions.append(m.group(2))
    return instructions, labels


def loops(instructions: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) index of every loop: a predicated backward branch at
    ``last`` to ``first``. Unconditional backward jumps (the returns of
    out-of-line retry code) are not loops."""
    out = []
    for i, ins in enumerate(instructions):
        m = _BRANCH.match(ins)
        if m and m.group(1) and labels[m.group(2)] <= i:
            out.append((labels[m.group(2)], i))
    return out


def trip_count(instructions: list[str], first: int, last: int) -> int:
    """Trips of the loop [first, last]: its back edge's predicate is set by
    ``ISETP.NE*.AND P, PT, Rc, LIMIT`` on a counter stepped inside the loop by
    ``VIADD / IADD3 Rc, Rc, STEP`` and set to an immediate (or RZ) before it."""
    pred = re.match(r"@(!?)(P\d+)", instructions[last])
    if pred is None or pred.group(1):
        raise SassParseError(f"loop {first}..{last}: back edge {instructions[last]!r}")
    p = pred.group(2)
    setp = next((ins for ins in reversed(instructions[first:last])
                 if re.match(rf"(?:I?SETP|PLOP3)\S*\s+{p},", ins)), None)
    if setp and (flag := re.match(rf"PLOP3\.LUT\s+{p},\s*PT,\s*PT,\s*PT,\s*(UP\d+),\s*0x80,", setp)):
        return _two_pass_trips(instructions, first, last, flag.group(1))
    m = setp and re.match(r"ISETP\.NE\S*\.AND\s+P\d+,\s*PT,\s*(R\d+),\s*(0x[0-9a-f]+|\d+),", setp)
    if not m:
        raise SassParseError(f"loop {first}..{last}: no counter compare for {p} ({setp!r})")
    counter, limit = m.group(1), int(m.group(2), 0)
    step = None
    for ins in instructions[first:last]:
        s = re.match(rf"(?:VIADD|IADD3)\s+{counter},\s*(?:PT,\s*)?{counter},\s*(0x[0-9a-f]+|\d+)",
                     ins)
        if s:
            step = int(s.group(1), 0)
    init = None
    for ins in reversed(instructions[:first]):
        i = re.match(rf"(?:IMAD\.MOV\.U32\s+{counter},\s*RZ,\s*RZ,|MOV\s+{counter},)"
                     rf"\s*(RZ|0x[0-9a-f]+|\d+)$", ins)
        if i:
            init = 0 if i.group(1) == "RZ" else int(i.group(1), 0)
            break
        if re.match(rf"\S+\s+{counter}\b", ins):
            break
    if not step or init is None or (limit - init) % step or limit <= init:
        raise SassParseError(f"loop {first}..{last}: counter {counter} init {init} step {step} "
                             f"limit {limit}")
    return (limit - init) // step


def _set_uniform(ins: str, up: str) -> str | None:
    """``UPLOP3.LUT UPx, UPT, UPT, UPT, UPT, 0x80 / 0x40`` -> "true" / "false"."""
    m = re.match(rf"UPLOP3\.LUT\s+{up},\s*UPT,\s*UPT,\s*UPT,\s*UPT,\s*(0x80|0x40),", ins)
    return None if m is None else {"0x80": "true", "0x40": "false"}[m.group(1)]


def _two_pass_trips(instructions: list[str], first: int, last: int, up: str) -> int:
    """The two-trip loop ptxas builds on a uniform flag: ``up`` set true before
    the loop, copied into the back edge's predicate and then set false in it."""
    before = next((ins for ins in reversed(instructions[:first]) if re.match(rf"\S+\s+{up}\b", ins)),
                  "")
    inside = [_set_uniform(ins, up) for ins in instructions[first:last]
              if re.match(rf"\S+\s+{up}\b", ins)]
    if _set_uniform(before, up) != "true" or inside != ["false"]:
        raise SassParseError(f"loop {first}..{last}: flag {up} set {before!r} before, {inside} in")
    return 2


@dataclasses.dataclass(frozen=True)
class KStepSass:
    """One consumer K step's SASS, per thread: ``instructions`` counted (not
    NOT_DEQUANT), ``by_opcode`` their split by opcode family (IADD3.X ->
    IADD3), ``mma_kn`` the sum of k x n over its HGMMAs (weight elements per
    x plane), ``nested_trips`` the trip count of each loop nested in it."""

    instructions: int
    mma_kn: int
    nested_trips: tuple[int, ...] = ()
    by_opcode: tuple[tuple[str, int], ...] = ()

    def per_weight(self, planes: int = 1) -> float:
        """Counted instructions per weight element (planes: x planes per
        weight, 2 for float32 x): instructions x 128 / (mma_kn / planes)."""
        return self.instructions * WARPGROUP_THREADS * planes / self.mma_kn


def k_step_count(sass: str) -> KStepSass:
    """The consumer K-step loop's counts (module docstring)."""
    instructions, labels = parse(sass)
    found = loops(instructions, labels)
    with_mma = [(a, b) for a, b in found
                if any(opcode(i).startswith("HGMMA") for i in instructions[a:b + 1])]
    if not with_mma:
        raise SassParseError("no loop holds an HGMMA")
    first, last = min(with_mma, key=lambda ab: ab[1] - ab[0])
    weight = [1] * (last - first + 1)
    trips = []
    for a, b in found:
        if first <= a and b <= last and (a, b) != (first, last):
            n = trip_count(instructions, a, b)
            trips.append(n)
            for j in range(a - first, b - first + 1):
                weight[j] *= n
    counts: collections.Counter[str] = collections.Counter()
    mma_kn = 0
    for w, ins in zip(weight, instructions[first:last + 1]):
        op = opcode(ins)
        if shape := _HGMMA_SHAPE.match(op):
            mma_kn += int(shape.group(2)) * int(shape.group(3)) * w
        if not op.startswith(NOT_DEQUANT):
            counts[op.split(".")[0]] += w
    return KStepSass(instructions=sum(counts.values()), mma_kn=mma_kn, nested_trips=tuple(trips),
                     by_opcode=tuple(sorted(counts.items(), key=lambda kv: -kv[1])))


__all__ = ["DEQUANT_KERNELS", "NOT_DEQUANT", "KStepSass", "SassParseError", "disassemble", "k_step_count", "loops",
           "opcode", "parse", "trip_count"]
