"""The nine commands of `minimal-fsdp COMMAND` (the table in minimal_fsdp/__main__.py), one module
each: a short main(flags) from the flags, parsed once by config.parser, to library calls. Nothing
below imports a command.
Imports config, files, launch, models, data, checkpoint, hf, inference, eval, run and tools.
"""
