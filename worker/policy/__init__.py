"""The policy as files: ``models.py`` (``asyncrl model init``, loading a model and its tokenizer, checking a model
before a run uses it), ``lora_adapters.py`` (a LoRA run's adapter files and served names) and ``export.py`` (a
run's policy as a Hugging Face model directory). Nothing here imports torch at module level."""
