"""latentlm: served exact inference for latent-variable language models."""

__version__ = "0.1.0"
