"""infertrace: benchmark, profile and explain LLM inference."""

__version__ = "0.1.0"
