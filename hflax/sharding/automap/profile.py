"""Device profiles: what one accelerator and its links can do, as the cost model sees it.

Bandwidths are per device and per direction, in bytes/s. `inter_node_bandwidth` is what one
device can push to another node (for NVIDIA DGX-style nodes: one NIC per GPU). Presets
carry their source; the efficiency factors are not datasheet figures but what a well-tuned
program sustains (see each field's comment).
"""
from __future__ import annotations

import dataclasses
import json
import os

GB = 1e9
GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  name: str
  peak_flops: float             # dense bf16 FLOP/s per device
  memory_bandwidth: float       # HBM bytes/s per device
  intra_node_bandwidth: float   # bytes/s per device per direction (NVLink, ICI)
  inter_node_bandwidth: float   # bytes/s per device per direction (InfiniBand, DCN)
  devices_per_node: int         # devices sharing the fast intra-node links
  memory_bytes: float           # memory per device
  # Fraction of peak FLOP/s that large transformer matmul programs sustain (training and
  # prefill MFU). Megatron-class GPU training reports 0.4-0.55; 0.5 is used for presets.
  compute_efficiency: float = 0.5
  # Fraction of datasheet HBM / link bandwidth that streaming kernels and NCCL-class
  # collectives reach (about 0.8 for HBM copies and large all-reduces on NVLink/IB).
  bandwidth_efficiency: float = 0.8
  # Fixed start-up time of one collective (launch plus the first hop).
  collective_latency: float = 10e-6
  # Fraction of device memory plans may fill (the rest: runtime, fragmentation).
  usable_memory: float = 0.9
  # True where the devices share one host's compute (simulated CPU devices): a pool of any
  # size then computes with the whole host (rates above are per device with all of them
  # busy), and disjoint pools share the host (see host_concurrency).
  shared_compute: bool = False
  # On a shared host: how much faster two pools' small programs finish when dispatched at
  # once than one after the other (1 = they take turns; up to the number of cores, since a
  # small program leaves cores idle). Measured by calibrate(); None counts as 1.
  host_concurrency: float | None = None
  # Measured time of one controller call on a pool (fixed part and per device), where
  # calibrate() measured it; None leaves the simulator's Overheads defaults.
  call_overhead: float | None = None
  call_overhead_per_device: float | None = None
  source: str = ""

  def replace(self, **kw) -> DeviceProfile:
    return dataclasses.replace(self, **kw)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> DeviceProfile:
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in fields})

  def save(self, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=2)

  @classmethod
  def load(cls, path: str) -> DeviceProfile:
    with open(path) as f:
      return cls.from_json(json.load(f))


PRESETS = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 2,039 GB/s
    # HBM2e, NVLink 600 GB/s total (300 per direction). NVIDIA DGX A100 datasheet: 8 GPUs,
    # 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute = 25 GB/s per GPU.
    "a100-80gb": DeviceProfile(
        "a100-80gb", peak_flops=312e12, memory_bandwidth=2039 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB, devices_per_node=8,
        memory_bytes=80 * GB,
        source="NVIDIA A100 datasheet (SXM4 80GB); NVIDIA DGX A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1,979 TFLOPS BF16 with sparsity = 989
    # dense, 3.35 TB/s HBM3, NVLink 900 GB/s total. NVIDIA DGX H100 datasheet: 8 GPUs,
    # 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU.
    "h100-80gb": DeviceProfile(
        "h100-80gb", peak_flops=989e12, memory_bandwidth=3350 * GB,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, devices_per_node=8,
        memory_bytes=80 * GB,
        source="NVIDIA H100 datasheet (SXM5); NVIDIA DGX H100 datasheet"),
    # Google Cloud TPU v5e documentation (system architecture): 197 TFLOP/s BF16, 16 GiB
    # HBM2 at 819 GB/s, ICI 1,600 Gbps per chip, 256 chips per pod (2D torus). The ICI
    # domain is the pod, so "node" = pod; across pods traffic goes over the data-centre
    # network, taken here as 100 Gb/s per chip (an estimate, not a datasheet figure).
    "tpu-v5e": DeviceProfile(
        "tpu-v5e", peak_flops=197e12, memory_bandwidth=819 * GB,
        intra_node_bandwidth=100 * GB, inter_node_bandwidth=12.5 * GB, devices_per_node=256,
        memory_bytes=16 * GiB,
        source="Google Cloud TPU v5e docs (system architecture); DCN figure estimated"),
    # Google Cloud TPU v5p documentation: 459 TFLOP/s BF16, 95 GiB HBM2e at 2,765 GB/s,
    # ICI 4,800 Gbps per chip, up to 8,960 chips per pod (3D torus). DCN as for v5e:
    # an estimate.
    "tpu-v5p": DeviceProfile(
        "tpu-v5p", peak_flops=459e12, memory_bandwidth=2765 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=12.5 * GB, devices_per_node=8960,
        memory_bytes=95 * GiB,
        source="Google Cloud TPU v5p docs (system architecture); DCN figure estimated"),
}


def get_profile(name: str) -> DeviceProfile:
  """A named preset ("a100-80gb", "h100-80gb", "tpu-v5e", "tpu-v5p")."""
  if name not in PRESETS:
    raise ValueError(f"unknown device profile {name!r}; presets: {sorted(PRESETS)}")
  return PRESETS[name]
