"""Example asyncrl plugins (README, "Plugins"): ``advantages.leave_one_out``, ``losses.reinforce`` and
``gates.too_easy``."""
