from repro.models.autoregressive import AutoregressiveTransformer, GenerationState
from repro.models.transformer import Transformer, TransformerLayer, sinusoid

__all__ = ["AutoregressiveTransformer", "GenerationState", "Transformer", "TransformerLayer", "sinusoid"]
