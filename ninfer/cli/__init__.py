"""The `ninfer` command line: every subcommand and flag lives here (flags.py: the flags and what they
build; servers.py: engine, gateway, serve; generate.py: one completion; main.py: the parser).
Importing it loads no torch: only `ninfer engine`, `serve` and in-process `generate` do, when they run."""
