"""Weight sync, both ends: ``publish.py`` (trainer: files or a bucketed process-group broadcast; its docstring
draws the whole path) and ``load.py`` (inference: the vLLM worker extension and the orchestrator's receiver)."""
