"""What every engine's operation is made of: what an engine is asked and answers (engine.py:
Save, Load, the Engine protocol, the Report), its steps and their one undo (steps.py), what each
of its timings is (timings.py), what the undo needs to know (plan.py, a plan per operation) and
the watchdog that runs it if pos dies (watchdog.py), CRIU's lazy-pages daemon that the undo may
have to end (lazypages.py), what the driver cannot restore (restorable.py), onto which GPU
(gpumap.py), what an image records (manifest.py)."""
