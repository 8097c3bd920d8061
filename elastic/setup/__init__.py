"""What a run is set up from, checked before any actor starts.

Each module, lowest first (a module imports only those before it; ``tests/test_imports.py``):

* ``errors``: ``ConfigError``, the one error bad input raises, in every layer that reads it.
* ``presets``: the named model shapes (plain data).
* ``config``: the config tree (pydantic) and its shape: ranges, choices, fields that must agree.
  Parsing reads nothing but the values given.
* ``memory_estimate``: the memory a rank needs for a model shape and a layout (arithmetic).
* ``dataset``: the datasets a config names, and whether its data can be read.
* ``preflight``: the checks that read storage and data, and ``build_config``/``load_config``,
  the ways a run gets its config, which run them.
* ``hooks``: the user's hooks and their defaults, tried on a sample before the run.
* ``preset_tables``: the tables of docs/presets.md.
"""
