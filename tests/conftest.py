"""Every test sees 8 simulated CPU devices, so every mesh layout can be exercised here."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
  return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
