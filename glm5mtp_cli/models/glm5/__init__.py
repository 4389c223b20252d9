"""The GLM-5 target and its MTP layer (PyTorch path; CPU and CUDA, fp32/bf16)."""

from .decoder import ForwardOut, Glm5ForCausalLM, Glm5MtpLayer, TrainOut

__all__ = ["ForwardOut", "Glm5ForCausalLM", "Glm5MtpLayer", "TrainOut"]
