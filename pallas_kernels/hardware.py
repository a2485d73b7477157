"""The H200 SXM, described once: what the kernels size themselves by, what the
deviceless compile target (k3jax/data/h200.txtpb) declares, and the rates
the cost and latency models charge.

Two kinds of number live here, kept apart by their fields' names:

* facts of the chip (SM count, shared memory, registers): Hopper GH100
  figures, the same as XLA's own H100 SXM target spec
  (xla/backends/gpu/target_config/specs/h100_sxm.txtpb);
* rates (``*_per_s``): public figures with their sources in ``sources``.
  The models built on them make predictions, not measurements.

tests/test_hardware.py holds the target file to the chip facts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class GpuHardware:
    """One GPU of an NVLink node, and the InfiniBand NICs joining the nodes."""

    name: str
    num_sms: int                        # streaming multiprocessors
    smem_per_block_optin: int           # bytes of shared memory one CTA may opt into
    smem_per_sm: int                    # bytes of shared memory per SM
    registers_per_sm: int               # 32-bit registers per SM
    max_registers_per_thread: int
    lanes_per_sm: int                   # CUDA-core lanes (FP32 units) per SM
    l2_bytes: int
    hbm_bytes: int                      # device memory as the driver reports it
    clock_hz: float                     # boost clock
    dense_bf16_flops_per_s: float       # dense bf16 matmul rate (cuBLAS class)
    hbm_copy_bytes_per_s: float         # device-to-device copy (read + write) rate
    hbm_peak_bytes_per_s: float         # the data sheet's figure
    nvlink_bus_bytes_per_s: float       # NCCL all-gather / reduce-scatter bus bandwidth, 8 GPUs
    nvlink_peak_bytes_per_s: float      # the data sheet's figure, one direction
    collective_latency_s: float         # fixed cost of one collective or one ring step
    collective_sms: int                 # SMs a collective in flight keeps busy
    gpus_per_node: int                  # GPUs on one NVLink / NVSwitch node
    ib_bus_bytes_per_s: float           # NCCL's bandwidth through one InfiniBand NIC, one direction
    ib_peak_bytes_per_s: float          # one NIC's line rate, one direction (data sheet)
    nics_per_node: int                  # InfiniBand NICs of the compute fabric on one node
    ring_base_latency_s: float          # NCCL's fixed cost of a ring collective (LL protocol)
    nvlink_step_latency_s: float        # one NVLink step of a ring (LL)
    ib_step_latency_s: float            # one inter-node step of a ring (LL)
    ib_lone_step_latency_s: float       # the same with one rank a node (latencies exposed)
    net_step_floor_s: float             # the least a step of a ring spanning nodes takes
    sources: Mapping[str, str]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (int, float)) and not value > 0 and field.name != "collective_latency_s":
                raise ValueError(f"GpuHardware.{field.name} must be > 0, got {value!r}")
        if self.collective_latency_s < 0:
            raise ValueError(f"GpuHardware.collective_latency_s must be >= 0, "
                             f"got {self.collective_latency_s!r}")

    @property
    def sm_lane_ops_per_s(self) -> float:
        """CUDA-core lane operations per second on one SM (one op a lane a clock)."""
        return self.lanes_per_sm * self.clock_hz


H200 = GpuHardware(
    name="NVIDIA H200 SXM",
    num_sms=132,
    smem_per_block_optin=232_448,
    smem_per_sm=233_472,
    registers_per_sm=65_536,
    max_registers_per_thread=255,
    lanes_per_sm=128,
    l2_bytes=52_428_800,
    hbm_bytes=150_754_820_096,
    clock_hz=1.98e9,
    dense_bf16_flops_per_s=795e12,
    hbm_copy_bytes_per_s=4.3e12,
    hbm_peak_bytes_per_s=4.8e12,
    nvlink_bus_bytes_per_s=365e9,
    nvlink_peak_bytes_per_s=450e9,
    collective_latency_s=10e-6,
    collective_sms=20,
    gpus_per_node=8,
    ib_bus_bytes_per_s=48e9,
    ib_peak_bytes_per_s=50e9,
    nics_per_node=8,
    ring_base_latency_s=6.6e-6,
    nvlink_step_latency_s=0.6e-6,
    ib_step_latency_s=2.7e-6,
    ib_lone_step_latency_s=5.0e-6,
    net_step_floor_s=1.0e-6,
    sources={
        "chip": "Hopper GH100 as in XLA's h100_sxm.txtpb target spec: 132 SMs, 228 KiB SMEM per SM "
                "(227 KiB = 232,448 B opt-in per block), 64 K registers per SM, 50 MiB L2, "
                "1.98 GHz boost clock",
        "hbm_bytes": "141 GB HBM3e (NVIDIA H200 data sheet) less what the driver keeps: 140.4 GiB",
        "dense_bf16_flops_per_s": "about 795 TFLOP/s dense bf16 (cuBLAS, as on the H100 SXM; "
                                  "public figures, not measured by this project)",
        "hbm_copy_bytes_per_s": "HBM copy 4.0-4.3 TB/s (public figures; 4.8 TB/s is the data sheet's "
                                "peak), not measured by this project",
        "nvlink_bus_bytes_per_s": "NCCL all-gather / reduce-scatter bus bandwidth on 8 GPUs over "
                                  "NVLink 4, about 360-370 GB/s on 8 x H100 (NVIDIA/nccl-tests#212, "
                                  "#326, NVIDIA/nccl#1281); the H200 has the same NVLink 4",
        "nvlink_peak_bytes_per_s": "NVLink 4: 900 GB/s per GPU both directions together, so 450 GB/s "
                                   "each way (data sheet)",
        "hbm_peak_bytes_per_s": "4.8 TB/s HBM3e (NVIDIA H200 data sheet)",
        "collective_latency_s": "10 us per collective or ring step: an assumption, not measured",
        "gpus_per_node": "HGX H200: 8 GPUs joined by NVSwitch (NVIDIA H200 data sheet)",
        "ib_bus_bytes_per_s": "NCCL through one ConnectX-7 at NDR 400 Gb/s: 46-48 GB/s per NIC "
                              "(NVIDIA/nccl-tests#290), 48-49 GB/s (NVIDIA/nccl-tests#267); a ring "
                              "collective across nodes moves its inter-node bytes through every NIC "
                              "of the node at once (NVIDIA/nccl-tests#160: its bus bandwidth is the "
                              "node's NICs together; NVIDIA/nccl#812: 192 GB/s on 8 x 200 Gb/s), an "
                              "all-to-all through one NIC a GPU (NVIDIA/nccl-tests#267, #130)",
        "ib_peak_bytes_per_s": "400 Gb/s = 50 GB/s each way per ConnectX-7 (DGX H200: eight "
                               "single-port ConnectX-7 VPI, up to 400 Gb/s InfiniBand; NVIDIA DGX "
                               "BasePOD reference architecture, core components)",
        "nics_per_node": "DGX H200: four OSFP ports serving eight single-port ConnectX-7 for the "
                         "compute fabric, one per GPU (NVIDIA DGX BasePOD reference architecture)",
        "ring_base_latency_s": "NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc): base "
                               "latency of a Ring collective with the LL protocol, 6.6 us; its "
                               "prediction for an 8-GPU NVLink ring, 6.6 + 7 x 0.6 = 10.8 us, is "
                               "close to collective_latency_s; not measured by this project",
        "nvlink_step_latency_s": "NCCL tuning model hwLatencies, NVLINK, Ring, LL: 0.6 us a step "
                                 "(NVIDIA/nccl src/graph/tuning.cc); not measured by this project",
        "ib_step_latency_s": "NCCL tuning model hwLatencies, NET, Ring, LL: 2.7 us an inter-node "
                             "step (NVIDIA/nccl src/graph/tuning.cc; LL128 4.0, Simple 14); not "
                             "measured by this project",
        "ib_lone_step_latency_s": "NCCL tuning model: with one rank a node the latencies are "
                                  "fully exposed and a ring's inter-node step costs the Tree "
                                  "network latency, LL 5.0 us (NVIDIA/nccl src/graph/tuning.cc); "
                                  "not measured by this project",
        "net_step_floor_s": "NCCL tuning model: on a ring spanning nodes every step takes at least "
                            "the network overhead, 1 us on Intel x86 hosts (getNetOverhead; DGX "
                            "H200: Xeon Platinum 8480C); not measured by this project",
        "collective_sms": "20 of the 132 SMs saturate a GPU's NVLink and InfiniBand bandwidth with "
                          "communication kernels (DeepSeek-V3 Technical Report, arXiv 2412.19437, "
                          "section 3.2.2); taken as what one NCCL collective in flight occupies, "
                          "an assumption, not measured",
    },
)
