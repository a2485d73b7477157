"""SASS instruction counts of a Mosaic GPU kernel's consumer K-step loop
(sm_90a), from the PTX Mosaic dumps: the nvidia-cuda-nvcc wheel's ptxas
builds the cubin, the nvidia-cuda-nvdisasm wheel's nvdisasm disassembles it.

    sass = disassemble(ptx_text, bin_dir)       # nvdisasm -c text
    step = k_step_count(sass)                   # KStepSass
    step.per_weight(planes=1)                   # dequant_sass_per_weight

The K-step loop is the smallest loop (a conditional backward branch) that
holds WGMMAs (HGMMA). Its instructions are counted per thread, once per K
step, on its fast path: the cheapest path through the loop's basic blocks
that passes every block holding an HGMMA or one of the fast dequant's
bf16x2 multiplies (ON_FAST_PATH; so the exact path taken only for K steps
with extreme scale bytes is not on it, and ``loop_instructions`` counts
every path). A loop
nested inside counts ``trips`` times, the trip count read off its counter
(initialised before the loop, stepped by an immediate, compared with an
immediate by the back edge's ISETP) or ptxas's two-pass uniform flag.
Out-of-line code the loop jumps to (barrier try-wait retries) is not
counted: it runs only while waiting.

Not counted (NOT_DEQUANT): WGMMA and its fences, TMA, barriers and the
pipeline's own synchronisation (mbarrier SYNCS, BAR, MEMBAR, FENCE, DEPBAR).
Everything else in the loop is charged to the weight dequantization: the
integer / float ALU work, the SMEM loads of the codes and scales, the SMEM
stores of the bf16 tile, any x reshuffle and the loop's own bookkeeping.

``dequant_sass_per_weight`` = counted instructions per thread per K step x
128 threads / the weight elements one warpgroup's K step multiplies
(mma_weights / x planes). The dequantized weights are the operand the
HGMMA takes from registers where it takes one (the swap-AB kernel's A:
m x k of each HGMMA), else its B from SMEM (k x n).
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

ON_FAST_PATH = ("HGMMA", "HMUL2")
"""Opcodes every block of which the K step's fast path passes: the WGMMAs
and the fast dequantization's bf16x2 multiplies (mxfp4_fast.SEQUENCE)."""

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"^(@!?U?P\d+\s+)?BRA\s+`?\(?(\.L_x_\d+)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)")
_HGMMA_REGISTER_A = re.compile(r"HGMMA\S*\s+R\d+,\s*R\d+,")   # A from registers, not gdesc


class SassParseError(ValueError):
    """The disassembly has no K-step loop, or a nested loop's trip count
    cannot be read off its counter."""


class NoKStepLoop(SassParseError):
    """No loop holds an HGMMA: the launch's K steps and tiles are few enough
    that the compiler left none (a small model's single K step)."""


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


def opcode_and_operands(instruction: str) -> str:
    """``@P2 HGMMA.64x8x16 R24, ...`` -> ``HGMMA.64x8x16 R24, ...`` (no predicate)."""
    return instruction.split(None, 1)[1] if instruction.startswith("@") else instruction


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
    copied = _flag_op(setp) if setp else None
    if copied is not None and copied[1] is not None:
        return _two_pass_trips(instructions, first, last, copied[1])
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


_PLOP3 = re.compile(r"U?PLOP3\.LUT\s+(U?P\d+),\s*U?PT,\s*(U?PT|U?P\d+),\s*(U?PT|U?P\d+),"
                    r"\s*(U?PT|U?P\d+),\s*(0x[0-9a-f]+),")


def _flag_op(ins: str) -> tuple[str, str | None, int] | None:
    """A predicate set by PLOP3 from constants or copied from one flag:
    (dst, source flag or None, value or lut) or None."""
    m = _PLOP3.match(ins)
    if m is None:
        return None
    dst, srcs, lut = m.group(1), [s for s in m.group(2, 3, 4)], int(m.group(5), 0)
    flags = [s for s in srcs if not s.endswith("PT")]
    if not flags:
        return dst, None, (lut >> 7) & 1          # all inputs true: the table's top bit
    if len(flags) == 1 and lut == 0x80:
        return dst, flags[0], 1                   # a copy of the one flag
    return None


def _writes_predicate(ins: str, pred: str) -> bool:
    return bool(re.match(rf"(?:@!?U?P\d+\s+)?\S+\s+(?:\S+,\s*)?{pred},", ins)) or \
        bool(re.match(rf"(?:@!?U?P\d+\s+)?\S+\s+{pred}\b", ins))


def _two_pass_trips(instructions: list[str], first: int, last: int, flag: str) -> int:
    """The two-trip loop ptxas builds on a flag: ``flag`` set true before the
    loop, copied into the back edge's predicate and then set false in it."""
    before = next((ins for ins in reversed(instructions[:first]) if _writes_predicate(ins, flag)),
                  "")
    inside = [_flag_op(ins) for ins in instructions[first:last] if _writes_predicate(ins, flag)]
    if _flag_op(before) != (flag, None, 1) or inside != [(flag, None, 0)]:
        raise SassParseError(f"loop {first}..{last}: flag {flag} set {before!r} before, "
                             f"{inside} in")
    return 2


@dataclasses.dataclass(frozen=True)
class KStepSass:
    """One consumer K step's SASS, per thread, on its fast path (module
    docstring): ``instructions`` counted (not NOT_DEQUANT), ``by_opcode``
    their split by opcode family (IADD3.X -> IADD3), ``mma_weights`` the
    weight elements its HGMMAs multiply (per x plane: m x k of an HGMMA with
    A in registers, else k x n), ``nested_trips``
    the trip count of each loop nested in the K-step loop,
    ``loop_instructions`` the count over every instruction of the loop (all
    paths, e.g. the exact path for extreme scales as well)."""

    instructions: int
    mma_weights: int
    nested_trips: tuple[int, ...] = ()
    by_opcode: tuple[tuple[str, int], ...] = ()
    loop_instructions: int = 0

    def per_weight(self, planes: int = 1) -> float:
        """Counted instructions per weight element (planes: x planes per
        weight, 2 for float32 x): instructions x 128 / (mma_weights / planes)."""
        return self.instructions * WARPGROUP_THREADS * planes / self.mma_weights


def _successors(instructions: list[str], labels: dict[str, int], first: int, last: int,
                end: int) -> list[int]:
    """Forward successors (instruction indices inside [first, last]) of the
    block ending at ``end``: backward branches (loop back edges) and jumps
    out of the loop (retry code) are not followed."""
    ins = instructions[end]
    m = _BRANCH.match(ins)
    if m is None:
        out = [] if opcode(ins).startswith(("EXIT", "RET")) else [end + 1]
    else:
        target = labels[m.group(2)]
        out = ([end + 1] if m.group(1) else []) + ([target] if end < target else [])
    return [i for i in out if first <= i <= last]


def _fast_path(instructions: list[str], labels: dict[str, int], first: int, last: int,
               weight: list[int]) -> list[int]:
    """Indices of the cheapest path (counted instructions x weight) from
    ``first`` to ``last`` that passes every block holding an ON_FAST_PATH
    opcode."""
    leaders = {first, last + 1}
    leaders |= {t for t in labels.values() if first <= t <= last}
    leaders |= {i + 1 for i in range(first, last + 1) if _BRANCH.match(instructions[i])
                or opcode(instructions[i]).startswith(("EXIT", "RET"))}
    starts = sorted(t for t in leaders if first <= t <= last)
    ends = [b - 1 for b in starts[1:]] + [last]
    block_of = {s: k for k, s in enumerate(starts)}

    def cost(k: int) -> int:
        return sum(weight[i - first] for i in range(starts[k], ends[k] + 1)
                   if not opcode(instructions[i]).startswith(NOT_DEQUANT))

    required = [any(opcode(instructions[i]).startswith(ON_FAST_PATH)
                    for i in range(starts[k], ends[k] + 1)) for k in range(len(starts))]
    inf = float("inf")
    dist, back = [inf] * len(starts), [-1] * len(starts)
    dist[0] = cost(0)
    for j in range(len(starts)):
        if dist[j] == inf:
            continue
        for target in _successors(instructions, labels, first, last, ends[j]):
            k = block_of[target]
            if any(required[j + 1:k]):   # the path may not skip an HGMMA block
                continue
            if dist[j] + cost(k) < dist[k]:
                dist[k], back[k] = dist[j] + cost(k), j
    k = len(starts) - 1
    if dist[k] == inf:
        raise SassParseError(f"loop {first}..{last}: no path through its HGMMAs")
    path = []
    while k >= 0:
        path = list(range(starts[k], ends[k] + 1)) + path
        k = back[k]
    return path


def k_step_count(sass: str) -> KStepSass:
    """The consumer K-step loop's counts on its fast path (module docstring)."""
    instructions, labels = parse(sass)
    found = loops(instructions, labels)
    with_mma = [(a, b) for a, b in found
                if any(opcode(i).startswith("HGMMA") for i in instructions[a:b + 1])]
    if not with_mma:
        raise NoKStepLoop("no loop holds an HGMMA")
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
    mma_weights = 0
    for i in _fast_path(instructions, labels, first, last, weight):
        op, w = opcode(instructions[i]), weight[i - first]
        if shape := _HGMMA_SHAPE.match(op):
            hm, hn, hk = (int(v) for v in shape.groups())
            register_a = _HGMMA_REGISTER_A.match(opcode_and_operands(instructions[i]))
            mma_weights += (hm if register_a else hn) * hk * w
        if not op.startswith(NOT_DEQUANT):
            counts[op.split(".")[0]] += w
    every = sum(w for w, ins in zip(weight, instructions[first:last + 1])
                if not opcode(ins).startswith(NOT_DEQUANT))
    return KStepSass(instructions=sum(counts.values()), mma_weights=mma_weights, nested_trips=tuple(trips),
                     by_opcode=tuple(sorted(counts.items(), key=lambda kv: -kv[1])),
                     loop_instructions=every)


__all__ = ["DEQUANT_KERNELS", "NOT_DEQUANT", "ON_FAST_PATH", "KStepSass", "NoKStepLoop",
           "SassParseError",
           "disassemble", "k_step_count", "loops", "opcode", "parse", "trip_count"]
