"""Every decision about one K3 layer, made once: the shared-expert gate, the
padding rule (docs/spec.md §4 and §5), the kernel backend, the routed experts' storage
and the dtype, in one ``Layout`` that the modules, the planner, ``compile``,
the loader and the gradients read. None of them re-derives any of it.

The mesh (axes ``DATA`` and ``TENSOR``, with ``NODE`` outermost over several
nodes, defined in k3jax.layout.parallel and re-exported here) and the
ParallelConfig come first; ``make_layout`` turns them, with the model config,
into the Layout:

    backend   resolved once from the mesh's devices ("auto": pallas on a
              Hopper GPU, triton on other CUDA GPUs >= sm_80 with jax-triton,
              xla elsewhere; pallas_kernels.backend). A layout made without
              devices (no mesh, or an AbstractMesh: planning, abstract
              modules) resolves "auto" to "xla".
    experts   the routed experts' WeightFormat (k3jax.formats), resolved from
              the caller's choice and bound to this layout (its static facts,
              e.g. a packed format's dequant and K order, are in it); the
              modules, the loader and the tools call its methods. make_layout
              raises ExpertShardError when the format cannot be split this way.
    dtype     the activations' and the float weights' dtype.
    ep_dispatch  under EP, how rows reach the experts (EpDispatch: one
              gather, a gather staged over NODE then inside the node, or
              the dropless ragged all-to-all); AUTO until ``for_tokens``.
    ragged_emulated  whether ragged all-to-all runs as its CPU emulation
              (k3jax.parallel.ragged_a2a): True exactly when the mesh's devices are
              CPUs, where XLA does not implement the collective.

Token rows are split over ``token_axes``: data_axes + (TENSOR,) under
sequence parallelism, else data_axes ((DATA,), or (NODE, DATA) over several
nodes). The three layouts of an MLP and of the routed experts:

    MlpMode.REPLICATED   full weights; each device runs its own rows; no collective
    MlpMode.SP_SHARDED   gate/up columns and down rows split over TENSOR;
                         all-gather rows -> float32 partial MLP ->
                         float32 reduce-scatter rows -> activation dtype
    MlpMode.TP           same split, rows replicated over TENSOR; all-reduce

An SP-sharded MLP issues its gather and scatter either as the two collectives
(``SharedOverlap.NONE``) or as two rings of tp - 1 collective-permutes each,
every block's matmul running while the next block travels
(``SharedOverlap.RING``, k3jax.parallel.ring), summing the partials in
``ParallelConfig.shared_scatter_dtype``; or it moves weights instead of rows
(``SharedOverlap.WEIGHTS``): one all-gather per weight over TENSOR, then the
replicated MLP on own rows. At rest its weights are split the same way in
all three forms.

    MoEMode.LOCAL        every expert whole on every device
    MoEMode.TP           each expert's intermediate split over TENSOR (padded);
                         the routed latent is summed before the RMSNorm
    MoEMode.EP           whole experts over every axis; no padding. Under
                         sequence parallelism (or tp 1) rows are all-gathered
                         and the routed latent reduce-scattered over every
                         axis (or exchanged by ragged all-to-all); over plain
                         TP rows stay replicated over TENSOR (all-gathered
                         over the data axes only) and the routed latent is
                         reduce-scattered over them, then all-reduced over
                         TENSOR together with the shared expert's TP partial
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from k3jax.choices import layout_dtype
from k3jax.config import K3Config
from k3jax.formats import ExpertLayout, ExpertStorage, WeightFormat, get_format
from k3jax.layout import ep_dispatch_choice, shared_overlap_choice
from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.layout.expert_storage import ExpertShardError, padded_moe_intermediate
from k3jax.layout.parallel import NODE, TENSOR, EpDispatch, ParallelConfig, SharedOverlap
from k3jax.layout.placement import LayoutError, MlpLayout, MlpMode, mlp_layout
from k3jax.layout.redundant import ExpertSlots, resolve_placement
from k3jax.layout.user_mesh import check_mesh
from pallas_kernels.backend import XLA, Backend, BackendName, KernelBackend, parse_backend, resolve


class EpDispatchError(LayoutError):
    """An explicit ``--ep-dispatch`` form this layout cannot run."""


# --------------------------------------------------------------------------
# The MoE layout
# --------------------------------------------------------------------------
class MoEMode(enum.Enum):
    LOCAL = "local"
    TP = "tensor-parallel"
    EP = "expert-parallel"


class Dispatch(enum.Enum):
    """How the routed experts meet the token rows.

    OWN_ROWS     each device routes its own rows; they are all-gathered over
                 ``Layout.dispatch_axes`` (none: LOCAL) and the float32 routed
                 latent reduce-scattered back (LOCAL, TP under SP, EP under SP
                 or with tp 1).
    ALL_REDUCE   tp > 1 without SP (TP, or EP over plain TP): rows replicated
                 over TENSOR; under EP with dp > 1 they are all-gathered over
                 DATA (``Layout.dispatch_axes``) and the float32 routed latent
                 reduce-scattered over DATA; then the routed latent and the
                 shared expert's partial sums are all-reduced over TENSOR together.
    """

    OWN_ROWS = "own-rows"
    ALL_REDUCE = "all-reduce"


@dataclasses.dataclass(frozen=True)
class Layout(ExpertSlots):   # num_slots, local_experts: k3jax.layout.redundant
    """Everything decided for one K3 layer: placement, backend, expert
    storage, dtype (module docstring). Made by ``make_layout`` only.

    Modules, the planner, compile, the loader and the gradients read it; none
    re-derives anything in it. Hashable: jitted forwards are cached by it.
    """

    cfg: K3Config
    parallel: ParallelConfig
    dense_mlp: MlpLayout
    shared_mlp: MlpLayout
    moe_mode: MoEMode
    expert_shards: int          # devices splitting one expert's intermediate
    padded_moe_intermediate: int
    backend: KernelBackend      # the kernels' backend, resolved from the mesh's devices
    experts: WeightFormat       # the routed experts' format, bound to this layout
    dtype: jnp.dtype            # activations and float weights
    ep_dispatch: EpDispatch     # under EP: how rows reach the experts (AUTO until for_tokens)
    ragged_emulated: bool       # ragged all-to-all as its CPU emulation (CPU devices)
    expert_placement: ExpertPlacement | None = None   # redundant slots (.redundant); None: slot e = e

    # -- token rows --------------------------------------------------------
    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.parallel.token_axes

    @property
    def row_shards(self) -> int:
        return self.parallel.row_shards

    @property
    def x_TD(self) -> P:
        return P(self.token_axes, None)

    # -- routed experts --------------------------------------------------------
    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Axes that hold different experts, outermost first: under EP the
        data axes, and TENSOR when tp > 1 (with or without sequence
        parallelism). Device i of them (row-major) holds slots [i E_local,
        (i + 1) E_local), so node n holds a contiguous block; slot s holds
        expert s, or expert_placement.slot_expert[s] with redundant slots."""
        if self.moe_mode is not MoEMode.EP:
            return ()
        data = self.parallel.data_axes
        return (*data, TENSOR) if self.parallel.tp > 1 else data

    @property
    def expert_layout(self) -> ExpertLayout:
        """What the expert format reads of this layout: sizes, padding,
        the dense weights' specs, dtype and backend."""
        cfg = self.cfg
        return ExpertLayout(self.num_slots, cfg.routed_expert_hidden_size,
                            cfg.moe_intermediate_size, self.padded_moe_intermediate,
                            self.expert_shards, (self.w13_ELF, self.w13_ELF, self.w2_EFL),
                            self.dtype, self.backend)

    @property
    def w13_ELF(self) -> P:
        if self.moe_mode is MoEMode.EP:
            return P(self.expert_axes, None, None)
        if self.moe_mode is MoEMode.TP:
            return P(None, None, TENSOR)
        return P()

    @property
    def w2_EFL(self) -> P:
        if self.moe_mode is MoEMode.EP:
            return P(self.expert_axes, None, None)
        if self.moe_mode is MoEMode.TP:
            return P(None, TENSOR, None)
        return P()

    def moe_param_specs(self) -> dict[str, P]:
        """PartitionSpec of every MoE parameter (shared expert under ``shared.``).
        Router, latent projections and norm are replicated."""
        specs = {"router_DE": P(), "router_bias_E": P(), "lat_down_DL": P(),
                 "lat_norm_L": P(), "lat_up_LD": P(),
                 "w1_ELF": self.w13_ELF, "w3_ELF": self.w13_ELF, "w2_EFL": self.w2_EFL}
        specs.update({f"shared.{k}": v for k, v in self.shared_mlp.param_specs.items()})
        return specs

    @property
    def dispatch(self) -> Dispatch:
        """Which per-device MoE body runs (modules.moe and the planner read this)."""
        if self.parallel.tp > 1 and not self.parallel.sequence_parallel:
            return Dispatch.ALL_REDUCE
        return Dispatch.OWN_ROWS

    @property
    def dispatch_axes(self) -> tuple[str, ...]:
        """Axes over which token rows are all-gathered before the routed experts
        and their latent reduce-scattered after: every axis under EP (DATA
        only for EP over plain TP, whose rows are already whole on TENSOR),
        TENSOR for a tensor-parallel MoE under SP, none otherwise (plain TP
        holds all rows already and all-reduces instead; EP on one device, or
        EP over plain TP with dp 1, has nobody to exchange rows with, and XLA
        would keep the no-op collectives)."""
        if self.moe_mode is MoEMode.EP:
            if self.dispatch is Dispatch.ALL_REDUCE:
                return self.parallel.data_axes if self.parallel.dp > 1 else ()
            return self.expert_axes if self.parallel.ep > 1 else ()
        if self.moe_mode is MoEMode.TP and self.parallel.sequence_parallel:
            return (TENSOR,)
        return ()

    @property
    def dispatch_stages(self) -> tuple[tuple[str, ...], ...]:
        """The all-gathers of the routed rows, in order (the reduce-scatters
        of the latent run them backwards): one stage over ``dispatch_axes``
        (EpDispatch.GATHER, and every non-EP layout), or NODE first and then
        the axes inside the node (HIERARCHICAL). () when there is nothing to
        exchange or the rows move by all-to-all instead. Gathering over NODE
        first puts row blocks in (inside-node position, node) order; the
        staged reduce-scatter undoes exactly that order."""
        axes = self.dispatch_axes
        if not axes or self.ep_dispatch is EpDispatch.ALL_TO_ALL:
            return ()
        if self.ep_dispatch is EpDispatch.HIERARCHICAL:
            inside = tuple(a for a in axes if a != NODE)
            return ((NODE,), inside) if inside else ((NODE,),)
        return (axes,)

    @property
    def exchange_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """EpDispatch.ALL_TO_ALL: (axes between nodes, axes inside a node)
        of its two ragged stages, either () when that stage has one device
        (one node; one device a node)."""
        axes = self.dispatch_axes
        between = tuple(a for a in axes if a == NODE)
        inside = tuple(a for a in axes if a != NODE
                       and self.parallel.axis_sizes[a] > 1)
        return between, inside

    # -- overlap contract -------------------------------------------------------
    @property
    def shared_overlaps_routed(self) -> bool:
        """Does the compiled program run the shared expert's work under the
        routed experts'? A claim checked against the H200 schedule
        (tests/test_aot_layouts.py at 256 and 8192 tokens;
        tests/test_shared_weights_schedule.py for WEIGHTS at 2048 and 8192;
        compiled with k3jax.xla_options.GPU_COMPILER_OPTIONS).

        vLLM switches its shared/routed stream overlap off for a sharded shared
        expert because the expert issues collectives of its own, and two streams
        issuing collectives can deadlock. In one SPMD XLA program every device
        issues collectives in the same compiled order, so that hazard does not
        exist, and XLA's latency-hiding scheduler decides what overlaps:
        - replicated shared expert: no collective of its own; True;
        - SP-sharded with SharedOverlap.RING: its collective-permutes stay
          asynchronous with a matmul under each; True;
        - SP-sharded with SharedOverlap.WEIGHTS (any dp): its two weight
          all-gathers stay asynchronous, gate/up with the first routed
          grouped matmul under it, down with the second (its start follows
          the first grouped matmul: XLA keeps one all-gather in flight, and
          the routed rows' gathers come between); True;
        - SP-sharded with SharedOverlap.NONE, tensor axis spanning the mesh
          (dp 1): its all-gather and reduce-scatter stay asynchronous with
          routed GEMMs between start and done; True;
        - SP-sharded with SharedOverlap.NONE and dp > 1: XLA schedules its
          all-gather with no routed GEMM under it (dp 2 x tp 4 at 256 tokens,
          and with EP at 8192 too); False: not kept, so not claimed;
        - plain TP (and EP over plain TP): its partial sum rides in the routed
          path's all-reduce (one all-reduce for both), fused rather than
          overlapped; False.
        - SP-sharded with a token-side form (NONE, RING) under
          EpDispatch.ALL_TO_ALL: XLA runs most of the ragged all-to-alls
          synchronously and the ring beside rather than under them, 4 of its
          14 permutes synchronous with nothing under them (2 x 8 H200, 256
          and 8192 tokens, tests/test_aot_nodes.py); False;
        - SharedOverlap.AUTO or EpDispatch.AUTO: True when every combination
          the tables pick for this layout is (the shared-form table's
          generator admits only those).
        """
        mode = self.shared_mlp.mode
        if mode is MlpMode.SP_SHARDED:
            if self.shared_mlp.overlap is SharedOverlap.AUTO or self._dispatch_undecided:
                return all(self.for_tokens(t).shared_overlaps_routed for t in self._pick_points())
            if self.shared_mlp.overlap is SharedOverlap.WEIGHTS:
                return True
            if self.moe_mode is MoEMode.EP and self.ep_dispatch is EpDispatch.ALL_TO_ALL:
                return False
            return self.shared_mlp.overlap is not SharedOverlap.NONE or self.parallel.dp == 1
        return mode is not MlpMode.TP

    @property
    def _dispatch_undecided(self) -> bool:
        """EpDispatch.AUTO on a layout whose rows it moves (EP over > 1 device)."""
        return (self.ep_dispatch is EpDispatch.AUTO and self.moe_mode is MoEMode.EP
                and self.parallel.ep > 1)

    def _pick_points(self) -> tuple[int, ...]:
        """Token counts at which an AUTO choice of this layout can change: the
        entries of the shared-form and EP-dispatch tables it reads."""
        par = self.parallel
        points = set(shared_overlap_choice.first_tokens(par.tp, par.dp))
        if self._dispatch_undecided:
            points |= set(ep_dispatch_choice.first_tokens(par.ep, par.nodes))
        return tuple(sorted(points))

    def for_tokens(self, tokens: int) -> Layout:
        """This layout for ``tokens`` global tokens: SharedOverlap.AUTO in the
        shared expert and the dense MLP replaced by the forms the committed
        table picks (MlpLayout.for_tokens, with this layout's dtype); itself
        when both are concrete.
        The modules, the planner and ``compile`` call it with their static T."""
        shared = self.shared_mlp.for_tokens(tokens, self.dtype)
        dense = self.dense_mlp.for_tokens(tokens, self.dtype)
        dispatch = self._dispatch_for_tokens(tokens, shared)
        if shared is self.shared_mlp and dense is self.dense_mlp and dispatch is self.ep_dispatch:
            return self
        return dataclasses.replace(self, shared_mlp=shared, dense_mlp=dense, ep_dispatch=dispatch)

    def _dispatch_for_tokens(self, tokens: int, shared: MlpLayout) -> EpDispatch:
        """EpDispatch.AUTO -> the committed table's form for (ep, nodes,
        tokens) (k3jax.layout.ep_dispatch_choice), among the forms this layout
        admits (``_check_ep_dispatch``); a concrete form stays."""
        par = self.parallel
        if self.ep_dispatch is not EpDispatch.AUTO or self.moe_mode is not MoEMode.EP or par.ep == 1:
            return self.ep_dispatch          # concrete, or nothing to decide (read only under EP)
        form = EpDispatch(ep_dispatch_choice.pick(par.ep, par.nodes, tokens))
        if form is EpDispatch.ALL_TO_ALL and _all_to_all_refusal(self, shared):
            form = EpDispatch.HIERARCHICAL
        if form is EpDispatch.HIERARCHICAL and (par.nodes == 1 or self.moe_mode is not MoEMode.EP):
            form = EpDispatch.GATHER
        return form

    def overlap_forms(self) -> dict[str, str]:
        """The forms in force (JSON of run / plan / compile / bench): the shared
        expert's and the dense MLP's SharedOverlap value ("auto" until
        ``for_tokens`` resolves it) and their scatter dtypes."""
        return {"shared_expert": self.shared_mlp.overlap.value,
                "shared_expert_scatter_dtype": self.shared_mlp.scatter,
                "dense_mlp": self.dense_mlp.overlap.value,
                "dense_mlp_scatter_dtype": self.dense_mlp.scatter}

    def describe(self) -> str:
        lines = [f"parallel: {self.parallel.describe()}",
                 f"token rows split over {self.token_axes} into {self.row_shards} blocks",
                 f"dense MLP: {self.dense_mlp.mode.value} ({self.dense_mlp.reason})",
                 f"shared expert: {self.shared_mlp.mode.value} ({self.shared_mlp.reason})",
                 f"routed experts: {self.moe_mode.value}, {self.local_experts} per device"
                 f"{self.redundant_note}, "
                 f"intermediate {self.cfg.moe_intermediate_size} -> padded "
                 f"{self.padded_moe_intermediate} over {self.expert_shards} shard(s)",
                 f"routed dispatch: {self.dispatch.value}"
                 + (f", rows by {self.ep_dispatch.value}" if self.moe_mode is MoEMode.EP else "")
                 + (" (emulated: XLA:CPU has no ragged all-to-all)"
                    if self.ep_dispatch is EpDispatch.ALL_TO_ALL and self.ragged_emulated else ""),
                 f"shared expert may overlap routed work: {self.shared_overlaps_routed}"]
        if (line := self.experts.describe()) is not None:
            lines.append(line)
        return "\n".join(lines)


def make_layout(cfg: K3Config, parallel: ParallelConfig,
                mesh: Mesh | AbstractMesh | None = None, *, backend: Backend = "auto",
                experts: str | ExpertStorage | WeightFormat = ExpertStorage.DENSE,
                dtype=jnp.float32, expert_placement: ExpertPlacement | None = None) -> Layout:
    """Every placement and build choice of one K3 layer on a (dp, tp) mesh.
    ``mesh`` (the modules') must be the one ``parallel`` describes; its
    devices resolve ``backend`` (a name, BackendName or KernelBackend) once
    (no devices: "auto" is "xla"). ``experts``: a format's name, an
    ExpertStorage or a WeightFormat, held bound to the layout. ``dtype``:
    one of k3jax.choices.LAYOUT_DTYPES or its name. ValueError for a dtype
    no kernel takes or a choice that is none (naming the choices),
    LayoutError when a size does not split over the mesh, ExpertShardError
    when the format (of a model with MoE layers) refuses the split.
    ``expert_placement`` with ``parallel.redundant_experts``: the redundant
    expert slots (k3jax.layout.redundant; RedundantExpertsError naming the flag)."""
    dtype = layout_dtype(dtype, "make_layout")
    fmt = get_format(experts)
    if mesh is not None:
        check_mesh(mesh, parallel, "make_layout")
    devices = list(mesh.devices.flat) if isinstance(mesh, Mesh) else None
    auto = parse_backend(backend) is BackendName.AUTO
    resolved = XLA if auto and not devices else resolve(backend, devices)
    placement = resolve_placement(cfg, parallel, expert_placement)
    if parallel.expert_parallel:
        moe_mode = MoEMode.EP
        if placement is None and cfg.num_experts % parallel.ep:
            raise LayoutError(f"expert parallel: num_experts {cfg.num_experts} is not divisible "
                             f"by the EP size dp*tp = {parallel.ep}")
        shards = 1
        padding_shards = parallel.ep if parallel.pad_under_ep else 1
    elif parallel.tp > 1:
        moe_mode = MoEMode.TP
        shards = padding_shards = parallel.tp
    else:
        moe_mode = MoEMode.LOCAL
        shards = padding_shards = 1
    padded = padded_moe_intermediate(cfg.moe_intermediate_size, padding_shards,
                                     cfg.min_moe_intermediate_per_partition)
    layout = Layout(cfg=cfg, parallel=parallel,
                    dense_mlp=mlp_layout(parallel, cfg.hidden_size, cfg.intermediate_size,
                                         layer_kind="dense"),
                    shared_mlp=mlp_layout(parallel, cfg.hidden_size,
                                          cfg.shared_intermediate_size, layer_kind="moe"),
                    moe_mode=moe_mode, expert_shards=shards, padded_moe_intermediate=padded,
                    backend=resolved, experts=fmt, dtype=dtype,
                    ep_dispatch=parallel.ep_dispatch,
                    ragged_emulated=bool(devices) and devices[0].platform == "cpu",
                    expert_placement=placement)
    if cfg.num_moe_layers and (why := fmt.split_refusal(layout.expert_layout)):
        raise ExpertShardError(why)
    _check_ep_dispatch(layout)
    return dataclasses.replace(layout, experts=fmt.bind(layout.expert_layout))


def _all_to_all_refusal(layout: Layout, shared: MlpLayout) -> str | None:
    """Why EpDispatch.ALL_TO_ALL cannot run in ``layout`` (with the shared
    expert ``shared``), or None when it can."""
    if layout.moe_mode is not MoEMode.EP:
        return "needs --expert-parallel"
    if layout.dispatch is not Dispatch.OWN_ROWS:
        return ("needs each device to own its rows (--sequence-parallel, or tp 1): over plain "
                "TP the rows are replicated on the tensor axis")
    if shared.mode is MlpMode.SP_SHARDED and shared.overlap is SharedOverlap.WEIGHTS:
        return "does not combine with --shared-overlap weights (its body gathers the rows)"
    return None


def _check_ep_dispatch(layout: Layout) -> None:
    """LayoutError for an explicit EpDispatch the layout cannot run."""
    form, par = layout.ep_dispatch, layout.parallel
    if form in (EpDispatch.AUTO, EpDispatch.GATHER):
        return
    if layout.moe_mode is not MoEMode.EP:
        raise EpDispatchError(f"--ep-dispatch {form.value} needs --expert-parallel")
    if form is EpDispatch.HIERARCHICAL and par.nodes == 1:
        raise EpDispatchError("--ep-dispatch hierarchical needs --nodes > 1 (on one node it is "
                              "the plain gather)")
    if form is EpDispatch.ALL_TO_ALL and (why := _all_to_all_refusal(layout, layout.shared_mlp)):
        raise EpDispatchError(f"--ep-dispatch all-to-all {why}")
