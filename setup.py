"""fire_jax: FIRE feedback-refinement for LLaVA-NeXT in JAX / Flax NNX."""

from setuptools import find_packages, setup

setup(
    name="fire_jax",
    version="0.1.0",
    description="FIRE (feedback-refinement) and VLRMBench for LLaVA-NeXT in JAX/Flax NNX",
    python_requires=">=3.10",
    packages=find_packages(include=["fire_jax", "fire_jax.*"]),
    package_data={"fire_jax": ["assets/**/*", "eval/paper_results/*.json", "vlrmbench/*.json"]},
    include_package_data=True,
    install_requires=[
        "jax>=0.10",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "ml-collections>=1.1",
        "numpy",
        "pillow",
        "safetensors",
        "gguf",  # fire_jax.convert.gguf: llama.cpp model files
        "tokenizers",
        "tqdm",
        "tensorflow-datasets>=4.9.10",
        "array-record",
        "grain>=0.2.18",
        "tensorboardX",
        "matplotlib",
        "fastapi",  # fire_jax.serve and fire_jax.demo
        "uvicorn",
        "openai",  # api: model specs, and the serve tests' client
    ],
    extras_require={
        # The PyTorch reference side of the parity tests (CPU build of torch, pinned); pytest-xdist runs the
        # test files on every core (tests/conftest.py sizes the workers to the cores and the free memory).
        "test": ["torch==2.13.0", "transformers>=5.24", "peft>=0.21", "pycocoevalcap", "pytest", "pytest-xdist",
                 "scikit-learn", "selenium"],  # selenium: tests/test_demo.py drives the demo in Debian chromium
    },
)
