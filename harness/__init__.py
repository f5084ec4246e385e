"""The development harness: GPU suite, kernel benchmark, offline inspection, byte traffic, plan tuning, profiler
and coverage census. It measures the package (``hf_rmsnorm``) from a checkout and is not part of it: the wheel
does not ship it, and it imports the package, never the other way round (``tests/test_layout.py``)."""
