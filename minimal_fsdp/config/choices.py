"""The bottom of the package's imports: ConfigError and the values each choice flag accepts. It
imports nothing from the package and nothing heavy, so config/flags.py (and `basic_training.py
--help`) reads the choices without importing torch, and the modules that act on a choice (plan.py,
fp8.py, gossip.py) import them from here: no import cycle.
"""


class ConfigError(ValueError):
    """Bad user input. Raised identically on every rank before any collective, printed as one
    line."""


# plan.py (the parallel plan)
DEVICE = ("auto", "xla")  # xla: xla.py
SHARDING = ("full-shard", "grad-shard", "no-shard", "hybrid-full-shard", "hybrid-grad-shard")
PRECISION = ("float32", "bf16", "fp8")
# the gradients' sum across ranks (--reduce_precision)
REDUCE_PRECISION = ("auto", "float32", "bf16")
DATA_PARALLEL = ("allreduce", "decentralized")
FSDP_UNITS = ("auto", "block", "model")
# --fsdp_unit auto: a model this small is one FSDP unit. Its step is bound by the host: FSDP2's
# hooks, gathers and reduce-scatters per block, and a compiled graph per block, cost more than
# overlapping its brief communication with compute saves (recipe S and GPT-2 124M ran faster so on 2
# H100s), and gathering it whole costs little memory.
SMALL_MODEL = 200_000_000
# --cuda_graphs auto: a model this small replays its compiled graph as CUDA graphs where no FSDP
# hooks surround it (one rank, DDP). Its step is the host launching kernels: recipe S (10.7M) took
# 9-12 ms a step compiled, 6.4 ms replayed, on one H100; GPT-2 124M at batch 32 is bound by the GPU
# (graphs would save nothing there). Where between the two the gain ends was not measured: 50M is a
# cautious bound.
GRAPHS_MODEL = 50_000_000

# fp8.py: torchao's scaling recipes
FP8_RECIPES = ("tensorwise", "rowwise")
# --fp8_layers: which layers --precision fp8 makes float8 (parallel/choose.py says what each means)
FP8_LAYERS = ("auto", "all", "head")

# data/tokenizer.py's (which imports torch: tests/config/test_commands.py checks they agree)
TOKENIZER_KINDS = ("char", "gpt2", "sentencepiece")

# gossip.py
TOPOLOGIES = ("complete", "ring", "exp", "alternating-exp-ring")

# Each --model (a family of models/families, which config may not import: it needs no torch) with
# its preset names, and the shape flags only some families take, by family. "tiny" is in several:
# without --model it is the first's. tests/models/test_families.py checks both against the families.
MODEL_PRESETS = {
    "gpt": ("tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"),
    "llama": ("tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-tiny"),
    "qwen2": ("tiny", "qwen2.5-0.5b"),
}
MODEL_FLAGS = {
    "gpt": ("bias",),
    "llama": ("num_kv_heads", "intermediate_size"),
    "qwen2": ("num_kv_heads", "intermediate_size"),
}

# The launchers' rank variables: which rank prints a flag error (config.flags) or a failure's one
# line (launch.failures) before torch.distributed has started.
RANK_VARIABLES = (
    "RANK",
    "PMI_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PALS_RANKID",
    "SLURM_PROCID",
)

# Dense bf16 tensor-core peaks; MFU is always relative to these (as nanoGPT and PaLM report it),
# also with --precision fp8: its float8 matmuls could run at twice the peak, but then fp8 and bf16
# MFU would not compare.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Devices one rank drives, where it is more than one: a torch_xla rank shards over its host's
# devices (SPMD, up to 8). The checkpoint's .metadata cap counts a chunk per device.
DEVICES_PER_RANK = {"xla": 8}
