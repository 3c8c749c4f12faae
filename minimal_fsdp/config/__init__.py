"""Every flag of every command: the section dataclasses, their TOML files, their checks and the
choice flags' values. Never imports torch, so `--help` and a mistyped flag answer at once.
Imports files (a TOML file of flags is read as every file a user names is).
"""
