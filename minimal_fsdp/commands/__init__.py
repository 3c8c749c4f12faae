"""The nine commands of `minimal-fsdp COMMAND` (the table in minimal_fsdp/__main__.py), one module
each: a short main(flags) from the flags, parsed once by config.parser, to library calls. Nothing
below imports a command.
Imports checkpoint, config, data, eval, hf, inference, launch, run, tools and train.
"""
