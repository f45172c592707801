"""The commands, one module each: what ``normconv <command>`` and ``normconv.<command>(...)`` run.

Each takes a ``Loaded`` model, the shared ``Options`` and its own arguments, runs its passes through the engine's
one door (``engine.door.rewrite``; export through ``engine.run.apply_passes`` and then ``normconv.onnx``) and returns
``(Report, model)`` (export and inspect: the Report). Commands never write files themselves: the door does.
"""
