"""distengine: a distributed, tensor-parallel inference engine for hybrid LLMs."""

__version__ = "0.1.0"
