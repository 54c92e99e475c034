"""llmp: record local LLM agent traffic and explain where the prefill time went."""

__version__ = "0.1.0"
