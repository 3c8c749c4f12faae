"""minimal_fsdp: pre-training GPT-2, Llama and Qwen2 with PyTorch FSDP2, one folder (or module) per
subject: a room. The table below is the package's layering, read by tests/test_architecture.py: a
room imports only the rooms its line names, each line's rooms are all used, and no chain of rooms
leads back to where it started. Each subpackage's __init__ docstring and docs/architecture.md state
the same lines, and the test checks that they agree. Bottom to top:

    files:
    config: files
    models: config
    launch: config, files
    profiling: config
    parallel: config, models
    data: config, files, launch
    metrics: config, launch, profiling
    checkpoint: config, files, launch, models, parallel
    hf: checkpoint, config, data, files, models
    inference: checkpoint, config, data, hf, launch, models, parallel
    eval: checkpoint, config, inference, launch
    train: eval, launch, metrics, parallel, profiling
    backends: checkpoint, config, hf, launch, models, parallel
    run: backends, checkpoint, config, data, hf, inference, launch, models, parallel, train
    __main__: config
    tools: __main__, checkpoint, config, files, hf, models, parallel
    commands: checkpoint, config, data, eval, hf, inference, launch, run, tools, train

__main__ names each command's module in its table (COMMANDS) and imports it by that name only after
its flags are parsed: the commands sit on top, and no room imports one.
"""
