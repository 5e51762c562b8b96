"""Weight sync, both ends: ``publish.py`` (trainer: files or a bucketed process-group broadcast; its docstring
draws the whole path) and ``load.py`` (inference: the vLLM worker extension and the orchestrator's receiver)."""

TEST_SKIP_LOAD_VAR = "ASYNCRL_TEST_SKIP_WEIGHT_LOAD"
"""Test only (case C14, ``tests/e2e/test_policy_check.py``; here, not in ``load.py``, so that the orchestrator reads
it without importing torch): when set (non-empty) in the inference server's
environment, :class:`WeightUpdateExtension` reads each new version and loads none of it, answering as if it had, so
the served policy silently stays the one it booted with (what the served-policy check must catch). The server inherits
its launcher's environment (``worker.inference.server.server_env``). Never set it in a real run."""
