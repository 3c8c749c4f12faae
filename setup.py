from pathlib import Path

from setuptools import find_packages, setup

requirements = [
    line.split("#")[0].strip()
    for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()
]

setup(
    name="minimal_fsdp",
    version="0.1.0",
    description="Pre-train GPT-2 and Llama-style models with PyTorch FSDP2, launched by mpiexec "
    "anywhere.",
    packages=find_packages(include=["minimal_fsdp", "minimal_fsdp.*"]),
    # `minimal-fsdp COMMAND`: train, sample, evaluate, export, prepare, progress, plan,
    # cluster, plot.
    entry_points={"console_scripts": ["minimal-fsdp=minimal_fsdp.__main__:main"]},
    python_requires=">=3.10",
    # tomllib (for --config) is in the standard library from Python 3.11 on.
    install_requires=[r for r in requirements if r] + ['tomli>=1.1; python_version < "3.11"'],
    extras_require={
        # MPI from wheels: no compiler or system MPI needed (on a cluster, build mpi4py against the
        # system MPI).
        "mpi": ["mpi4py>=4", "mpich"],
        "wandb": ["wandb"],  # --wandb
        "plot": ["matplotlib"],  # minimal-fsdp plot
        # --precision fp8: float8 training is pure Python on torch._scaled_mm. 0.16 is the oldest
        # release that works with torch 2.11's functional collectives; 0.17.0 is built for torch
        # 2.11 (and runs the CPU tests on 2.13). No upper bound, so that newer torch can take the
        # newer torchao it needs.
        "fp8": ["torchao>=0.16"],
        "debug": ["debugpy"],  # attaching VS Code to one rank (.vscode/launch.json)
        # --device xla (docs/parallelism.md): torch_xla's last release, 2.9, works with torch
        # 2.9 only.
        "xla": ["torch==2.9.*", "torch_xla==2.9.*"],
        # --hf_model with a hub name (a local directory needs nothing extra).
        "hf": ["huggingface_hub"],
        # pyyaml: the Kubernetes manifest test; transformers only checks our
        # Hugging Face import/export in the tests, it is never imported at run
        # time. Hugging Face datasets: openwebtext/hub/save_to_disk sources for
        # preparation and --streaming
        "data": ["datasets"],
        # torchao: tests/parallel/test_fp8.py runs the float8 layers on the CPU through torchao's
        # emulation. Mutation testing on demand (python tests/mutation.py): pinned, as
        # tests/mutation.py patches one of its internals to mutate functions decorated with
        # torch.no_grad() and lru_cache too.
        "mutation": ["mutmut==3.8.1"],
        # minimal-fsdp evaluate and --eval_tasks: EleutherAI's lm-evaluation-harness
        # (0.4.13's TaskManager).
        "eval": ["lm-eval>=0.4.13,<0.5"],
        # minimal-fsdp cluster and tests/multihost/test_multihost*.py: hosts as network namespaces,
        # made through netlink in pure Python (no iproute2 needed); they need root.
        "cluster": ["pyroute2"],
        # matplotlib and wandb: without them the tests of `minimal_fsdp.tools.plot` and of --wandb
        # (offline) skip.
        "dev": [
            "mpi4py>=4",
            "mpich",
            "pytest",
            "hypothesis",  # tests/fuzz: every reader driven with generated files and values
            "pyyaml",
            "transformers",
            "huggingface_hub",
            "datasets",
            "torchao>=0.16",
            "pyroute2",
            "matplotlib",
            "wandb",
            "ruff",  # .ci/run: lines of at most 100 characters, pyflakes (ruff.toml)
            # [hf]: the tests compare with the harness's own transformers backend
            "lm-eval[hf]>=0.4.13,<0.5",
        ],
    },
)
