"""Every flag of every command: the section dataclasses, their TOML files, their checks and the
choice flags' values. Imports nothing of the package and never torch, so `--help` and a mistyped
flag answer at once.
"""
