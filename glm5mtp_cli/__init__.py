"""glm5mtp: offline speculative generation with the GLM-5 multi-token-prediction draft head."""

__version__ = "0.1.0"
