"""The collectives of a compiled GPU program, in schedule order, and what runs
under each (read from ``compiled.as_text()``, a scheduled HLO module).

XLA's GPU pipeline turns a collective into a ``X-start`` / ``X-done`` pair
(or ``async-start`` / ``async-done`` around a computation holding it) and its
latency-hiding scheduler places independent work between the two. A pair it
could not overlap is marked ``"is_sync":true`` in its
``collective_backend_config`` (or left as the plain synchronous op, e.g.
``reduce-scatter(...)``). The entry computation of a scheduled module is
printed in schedule order, so "between start and done" is a range of lines.

What counts (``ScheduledCollective``):
    bytes            the larger of the collective's operand and result buffers
                     per device (the gathered buffer of an all-gather, the
                     unscattered one of a reduce-scatter), summed over the
                     operands XLA's combiner merged into it (``parts``).
    group            devices per replica group (``replica_groups`` in any of
                     XLA's three spellings; for a permute, the devices of its
                     largest connected set of source-target pairs, i.e. one ring).
    compute ops      instructions of the entry computation that launch work:
                     fusions (XLA's own and Triton GEMM fusions), custom calls
                     (cuBLAS GEMMs, Mosaic GPU / Pallas kernels, CUB sorts),
                     dots, convolutions, copies, sorts, loops, and any other
                     op that is not bookkeeping (parameters, constants, tuples,
                     get-tuple-element, bitcasts, partition ids) or another
                     collective.
    flops            2 * (result elements) * (contracted elements) of every
                     dot an op runs: a dot, a fusion calling one (however
                     nested), a cuBLAS GEMM custom call (its dimension numbers
                     in backend_config), a while loop's body times its known
                     trip count. Mosaic GPU kernels and other custom calls
                     report no FLOPs (0): their bodies are opaque to HLO.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all",
                    "ragged-all-to-all")

# Ops that launch no work of their own.
_BOOKKEEPING = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
    "after-all", "add-dependency", "opt-barrier", "domain", "iota-of-nothing",
})
_ASYNC_WRAPPERS = ("async-start", "async-update", "async-done")

_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
               "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
               "c64": 64, "c128": 128, "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8,
               "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e4m3": 8, "f8e3m4": 8}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# "[ROOT] %name = <shape> opcode(" -- the opcode is the first lower-case word followed by "(".
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"\b(?:calls|body|to_apply)=%?([\w.\-]+)")
_CALLS_LIST = re.compile(r"\bcalls=\{([^}]*)\}")
_BRANCHES = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_DIMS = re.compile(r"\b(lhs_contracting_dims)=\{([0-9,]*)\}")
_IS_SYNC = re.compile(r'"is_sync":\s*true')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class ComputeOp:
    """One compute op of the entry computation (see the module docstring)."""

    name: str
    opcode: str          # fusion, custom-call, dot, ...
    op_name: str         # jax metadata op_name ("" when XLA made the op up)
    flops: float
    target: str = ""     # custom_call_target of a custom call ("mosaic_gpu_v2", "__cublas$gemm")

    @property
    def is_matmul(self) -> bool:
        """A GEMM: an op with dot FLOPs, a Mosaic GPU kernel (whose FLOPs HLO
        cannot see; k3jax's Mosaic kernels are its grouped/MLP GEMMs), or a
        while loop (the XLA backend's blocked grouped matmul is a scan of
        block GEMMs; the loop's body is not counted in ``flops``)."""
        return self.flops > 0 or self.target.startswith("mosaic_gpu") or self.opcode == "while"


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the compiled entry computation, in schedule order."""

    kind: str            # all-gather | reduce-scatter | all-reduce | collective-permute | all-to-all
    name: str            # the HLO instruction name (of the start op when async)
    bytes: int           # per device: max(operand bytes, result bytes), all parts together
    group: int           # devices per replica group
    is_async: bool       # a start/done pair that stayed asynchronous
    compute_between: int  # compute ops scheduled strictly between start and done
    flops_between: float  # their FLOPs (dots only; see the module docstring)
    op_name: str         # the jax metadata op_name (named scopes, for attribution)
    parts: int = 1       # operands XLA's combiner merged into this one collective
    compute_ops: tuple[ComputeOp, ...] = ()   # the ops counted in compute_between
    group_devices: tuple[int, ...] = ()   # the device ids of one replica group (or ring)
    group_axes: tuple[str, ...] = ()      # or its mesh axes, where the HLO names them

    def flops_between_in(self, scope: str) -> float:
        """FLOPs between start and done of ops whose op_name has the path
        component ``scope`` (a ``jax.named_scope``)."""
        return sum(op.flops for op in self.compute_ops if in_scope(op.op_name, scope))

    def matmuls_between_in(self, scope: str) -> int:
        """GEMMs (ComputeOp.is_matmul) between start and done inside ``scope``."""
        return sum(op.is_matmul and in_scope(op.op_name, scope) for op in self.compute_ops)


def in_scope(op_name: str, scope: str) -> bool:
    """Whether a jax op_name ("jit(f)/shard_map/shared_expert/dot_general")
    lies inside the named scope ``scope``. A collective XLA combined from
    several carries all their names, "prefix/(a/all_gather:b/all_gather)",
    and is in each of their scopes."""
    return scope in re.split(r"[/:()]", op_name)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str           # everything after the operand list


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (arrays of a tuple summed; 4-bit types packed)."""
    bits = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        bits += _DTYPE_BITS[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return (bits + 7) // 8


def _dims(shape: str) -> list[int]:
    arrays = _ARRAY.findall(shape)
    if len(arrays) != 1:
        raise ValueError(f"expected one array shape, got {shape!r}")
    return [int(d) for d in arrays[0][1].split(",") if d]


def _split_operands(line: str, start: int) -> tuple[tuple[str, ...], str]:
    """The %operands of the call whose "(" is at ``start``, and the text after it."""
    depth, i = 0, start
    for i in range(start, len(line)):
        if line[i] in "({[":
            depth += 1
        elif line[i] in ")}]":
            depth -= 1
            if depth == 0:
                break
    inner = line[start + 1:i]
    return tuple(re.findall(r"%([\w.\-]+)", inner)), line[i + 1:]


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str, int]:
    """({computation: instructions in order}, entry name, num_partitions)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    header = _NUM_PARTITIONS.search(hlo_text.split("\n", 1)[0])
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        operands, attrs = _split_operands(line, m.end() - 1)
        comps[current].append(_Instr(m.group(2), m.group(3), m.group(4), operands, attrs))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text (expected compiled.as_text())")
    return comps, entry, int(header.group(1)) if header else 1


def _group_size(attrs: str, num_partitions: int) -> int:
    """Devices per replica group from any of XLA's spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:   # replica_groups=mesh['data'=1,'tensor'=8] {'data','tensor'}
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(sizes[a] for a in axes) if axes else num_partitions
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:   # iota: replica_groups=[groups,size]<=[...]
        return math.prod(int(d) for d in m.group(1).split(",")[1:])
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})?", attrs)
    if m:   # explicit: replica_groups={{0,1,2,3},{4,5,6,7}}, or {} = all devices
        return len(m.group(1).strip("{}").split(",")) if m.group(1) else num_partitions
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:   # collective-permute: devices of the largest connected set of pairs (one ring)
        return _largest_component([tuple(map(int, pair)) for pair
                                   in re.findall(r"\{(\d+),(\d+)\}", m.group(1))])
    raise ValueError(f"no replica groups in collective attributes: {attrs[:200]!r}")


def _one_group(attrs: str, num_partitions: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(device ids, mesh axis names) of the replica group holding the
    lowest device, from any of XLA's spellings (one of the two is empty):
    what a caller maps onto mesh axes (which axes the collective spans)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        axes = tuple(re.findall(r"'([^']+)'", m.group(2)))
        return (), axes or tuple(re.findall(r"'([^']+)'=", m.group(1)))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return tuple(int(i) for i in ids.reshape(shape[0], -1)[0]), ()
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})?", attrs)
    if m:
        if not m.group(1):
            return tuple(range(num_partitions)), ()
        return tuple(int(i) for i in m.group(1).strip("{}").split(",") if i), ()
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        pairs = [tuple(map(int, pair)) for pair in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        ring = {min(d for pair in pairs for d in pair)} if pairs else set()
        grew = True
        while grew:      # the connected set of pairs through the lowest device: one ring
            grew = False
            for a, b in pairs:
                if (a in ring) != (b in ring):
                    ring |= {a, b}
                    grew = True
        return tuple(sorted(ring)), ()
    return (), ()


def _largest_component(pairs: list[tuple[int, int]]) -> int:
    parent: dict[int, int] = {}

    def root(a: int) -> int:
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    for a, b in pairs:
        parent[root(a)] = root(b)
    sizes: dict[int, int] = {}
    for a in parent:
        sizes[root(a)] = sizes.get(root(a), 0) + 1
    return max(sizes.values(), default=0)


class _Flops:
    """FLOPs of dots, per computation (memoized), over one parsed module."""

    def __init__(self, comps: dict[str, list[_Instr]]):
        self.comps = comps
        self.shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
        self._memo: dict[str, float] = {}

    def of_computation(self, name: str) -> float:
        if name not in self._memo:
            self._memo[name] = 0.0   # guards recursion
            self._memo[name] = sum(self.of_instr(i) for i in self.comps.get(name, ()))
        return self._memo[name]

    def _dot(self, result_shape: str, lhs_shape: str, contracting: list[int]) -> float:
        lhs = _dims(lhs_shape)
        return 2.0 * math.prod(_dims(result_shape)) * math.prod(lhs[d] for d in contracting)

    def of_instr(self, instr: _Instr) -> float:
        if instr.opcode == "dot":
            m = _DIMS.search(instr.attrs)
            contracting = [int(d) for d in m.group(2).split(",") if d] if m else []
            return self._dot(instr.shape, self.shapes[instr.operands[0]], contracting)
        if instr.opcode == "custom-call":
            return self._custom_call(instr)
        if instr.opcode == "conditional":
            branches = [m.group(1) for m in _BRANCHES.finditer(instr.attrs)]
            for m in _BRANCH_LIST.finditer(instr.attrs):
                branches += re.findall(r"%([\w.\-]+)", m.group(1))
            return max((self.of_computation(b) for b in branches), default=0.0)
        if instr.opcode == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", instr.attrs)
            trips = _TRIP_COUNT.search(instr.attrs)
            return self.of_computation(body.group(1)) * (int(trips.group(1)) if trips else 1)
        called = [m.group(1) for m in _CALLS.finditer(instr.attrs)]
        for m in _CALLS_LIST.finditer(instr.attrs):
            called += re.findall(r"%([\w.\-]+)", m.group(1))
        if instr.opcode in ("all-reduce", "reduce-scatter", "reduce", "scatter", "sort", "map",
                            "reduce-window", "select-and-scatter"):
            return 0.0   # to_apply is a scalar reduction, not a dot
        return sum(self.of_computation(c) for c in called)

    def _custom_call(self, instr: _Instr) -> float:
        target = _CUSTOM_TARGET.search(instr.attrs)
        if target is None or "gemm" not in target.group(1).lower():
            return 0.0   # Mosaic GPU / Pallas kernels, sorts, ...: opaque
        config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
        contracting = [int(d) for d in re.findall(r"\d+", config.group(1))] if config else []
        result = _ARRAY.search(instr.shape)   # cuBLAS returns (result, workspace)
        return self._dot(f"{result.group(1)}[{result.group(2)}]", self.shapes[instr.operands[0]],
                         contracting)


def _custom_target(instr: _Instr) -> str:
    m = _CUSTOM_TARGET.search(instr.attrs) if instr.opcode == "custom-call" else None
    return m.group(1) if m else ""


def _op_name(attrs: str) -> str:
    m = _OP_NAME.search(attrs)
    return m.group(1).replace('\\"', '"') if m else ""


def _collective_kind(instr: _Instr, comps: dict[str, list[_Instr]]) -> tuple[str, str] | None:
    """(kind, phase) of a collective op: phase "sync", "start" or "done"."""
    op = instr.opcode
    if op in COLLECTIVE_KINDS:
        return op, "sync"
    for kind in COLLECTIVE_KINDS:
        if op == f"{kind}-start":
            return kind, "start"
        if op == f"{kind}-done":
            return kind, "done"
    if op in ("async-start", "async-done"):
        m = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
        wrapped = [i.opcode for i in comps.get(m.group(1), ())] if m else []
        kinds = [k for k in COLLECTIVE_KINDS if k in wrapped]
        if kinds:
            return kinds[0], "start" if op == "async-start" else "done"
    return None


def _is_compute(instr: _Instr, comps: dict[str, list[_Instr]]) -> bool:
    if instr.opcode in _BOOKKEEPING or instr.opcode in _ASYNC_WRAPPERS:
        return instr.opcode in _ASYNC_WRAPPERS and _collective_kind(instr, comps) is None
    if instr.opcode.endswith(("-start", "-done", "-update")) or instr.opcode in COLLECTIVE_KINDS:
        return False
    return instr.opcode not in ("send", "recv", "copy-start", "copy-done")


def collective_schedule(hlo_text: str) -> list[ScheduledCollective]:
    """Every collective of the entry computation of a compiled (scheduled) GPU
    program, in schedule order (the order of their start ops)."""
    comps, entry, num_partitions = _parse(hlo_text)
    instrs = comps[entry]
    flops = _Flops(comps)
    shapes = flops.shapes
    by_name = {i.name: i for i in instrs}
    done_of: dict[str, int] = {}
    for idx, instr in enumerate(instrs):
        kind = _collective_kind(instr, comps)
        if kind and kind[1] == "done":
            start = instr.operands[0]
            while start in by_name and by_name[start].opcode == "async-update":
                start = by_name[start].operands[0]
            done_of[start] = idx

    out = []
    for idx, instr in enumerate(instrs):
        kind = _collective_kind(instr, comps)
        if kind is None or kind[1] == "done":
            continue
        # a ragged all-to-all's operands are its input, its output buffer and
        # four offset / size arrays: one collective of its input's bytes
        ragged = kind[0] == "ragged-all-to-all"
        operands = instr.operands[:1] if ragged else instr.operands
        operand_bytes = sum(shape_bytes(shapes[o]) for o in operands if o in shapes)
        if kind[1] == "sync":
            result, between, is_async = instr.shape, [], False
        else:
            if instr.name not in done_of:
                raise ValueError(f"{instr.opcode} {instr.name} has no matching done op")
            done = instrs[done_of[instr.name]]
            result = done.shape
            between = [i for i in instrs[idx + 1:done_of[instr.name]] if _is_compute(i, comps)]
            is_async = not (_IS_SYNC.search(instr.attrs) or _IS_SYNC.search(done.attrs))
        ops = tuple(ComputeOp(i.name, i.opcode, _op_name(i.attrs), flops.of_instr(i),
                              _custom_target(i)) for i in between)
        attrs = instr.attrs if instr.opcode != "async-start" else _wrapped_attrs(instr, comps)
        devices, axes = _one_group(attrs, num_partitions)
        out.append(ScheduledCollective(
            kind=kind[0], name=instr.name, bytes=max(operand_bytes, shape_bytes(result)),
            group=_group_size(attrs, num_partitions), group_devices=devices, group_axes=axes,
            is_async=is_async, compute_between=len(ops), flops_between=sum((o.flops for o in ops), 0.0),
            op_name=_op_name(instr.attrs), parts=max(1, len(operands)), compute_ops=ops))
    return out


def _wrapped_attrs(instr: _Instr, comps: dict[str, list[_Instr]]) -> str:
    """Attributes of the collective inside an async-start's computation."""
    m = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
    inner = [i for i in comps.get(m.group(1), ()) if i.opcode in COLLECTIVE_KINDS] if m else []
    return inner[0].attrs if inner else instr.attrs


def collective_table(schedule: list[ScheduledCollective]) -> list[dict]:
    """JSON-ready rows: kind, bytes, group, async, compute_between {ops, flops}, op_name."""
    return [{"kind": c.kind, "name": c.name, "bytes": c.bytes, "group": c.group,
             "async": c.is_async, "parts": c.parts,
             "compute_between": {"ops": c.compute_between, "flops": c.flops_between},
             "op_name": c.op_name} for c in schedule]


__all__ = ["COLLECTIVE_KINDS", "ComputeOp", "ScheduledCollective", "collective_schedule",
           "collective_table", "in_scope", "shape_bytes"]

