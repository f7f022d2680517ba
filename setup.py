"""probjax_hk: Haiku-style fast neural models for JAX, with Pallas kernels."""
import setuptools

setuptools.setup(
    name="probjax_hk",
    version="0.1.0",
    description="Haiku-style fast neural models for JAX, with Pallas kernels.",
    python_requires=">=3.12",
    packages=setuptools.find_packages(include=["probjax_hk*", "ops*", "experiments*"]),
    install_requires=[
        # The GPU machines run exactly this JAX; CPU tests must match it.
        "jax==0.11.2",
        "jaxlib==0.11.2",
        # Without the [jax] extra: it would re-resolve jax.
        "dm-haiku==0.0.17",
        "optax",
        "chex",
        "numpy",
        "absl-py",
        "tqdm",
        # fit()'s checkpoints; 0.12.8 installs beside jax 0.11.2 unchanged.
        "orbax-checkpoint",
        # experiments/train.py's loss curve and sample grid (3.11 beside jax 0.11.2).
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis"],
        # experiments/benchmark_figures.py (matplotlib is now a requirement).
        "figures": ["matplotlib"],
    },
)
