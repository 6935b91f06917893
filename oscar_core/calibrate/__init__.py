"""Calibration, text to bundle: load a model (models, packaged), read text (data), hook attention and accumulate
statistics (statistics, distributed, calibration), derive rotations, centring and clips (derive), write the bundle
(export)."""
