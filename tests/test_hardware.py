"""The one hardware description (pallas_kernels.hardware.H200) and the
deviceless compile target (k3jax/data/h200.txtpb) state the same chip."""

import re

from k3jax.tools.aot import h200_target_config
from pallas_kernels.hardware import H200


def _field(text: str, name: str) -> float:
    m = re.search(rf"^\s*{name}:\s*([0-9.]+)\s*$", text, re.M)
    assert m, f"{name} missing from the target file"
    return float(m.group(1))


def test_target_file_states_the_hardware_description():
    text = h200_target_config()
    assert _field(text, "core_count") == H200.num_sms
    assert _field(text, "shared_memory_per_block_optin") == H200.smem_per_block_optin
    assert _field(text, "shared_memory_per_core") == H200.smem_per_sm
    assert _field(text, "registers_per_core_limit") == H200.registers_per_sm
    assert _field(text, "fpus_per_core") == H200.lanes_per_sm
    assert _field(text, "l2_cache_size") == H200.l2_bytes
    assert _field(text, "device_memory_size") == H200.hbm_bytes
    assert _field(text, "memory_bandwidth") == H200.hbm_peak_bytes_per_s
    assert _field(text, "clock_rate_ghz") * 1e9 == H200.clock_hz


def test_every_rate_names_its_source():
    rates = [f for f in H200.__dataclass_fields__ if f.endswith("_per_s")]
    for name in rates:
        assert name in H200.sources, f"{name} has no source"
