"""Example asyncrl plugins (README, "Plugins"): ``advantages.leave_one_out`` and ``losses.reinforce``."""
