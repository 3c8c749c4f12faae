from pathlib import Path

from setuptools import find_packages, setup

requirements = [line.split("#")[0].strip() for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()]

setup(
    name="minimal_fsdp",
    version="0.1.0",
    description="Pre-train GPT-2 and Llama-style models with PyTorch FSDP2, launched by mpiexec anywhere.",
    packages=find_packages(include=["minimal_fsdp", "minimal_fsdp.*"]),
    python_requires=">=3.10",
    install_requires=[r for r in requirements if r],
    extras_require={
        # MPI from wheels: no compiler or system MPI needed (on a cluster, build mpi4py against the system MPI).
        "mpi": ["mpi4py>=4", "mpich"],
        # Hugging Face datasets: openwebtext/hub/save_to_disk sources for preparation and --streaming
        "data": ["datasets"],
        "dev": ["mpi4py>=4", "mpich", "pytest", "datasets"],
    },
)
