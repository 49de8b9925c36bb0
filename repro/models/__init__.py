from .autoregressive import AutoregressiveTransformer, GenerationState
from .transformer import Transformer, TransformerLayer, sinusoid

__all__ = ["AutoregressiveTransformer", "GenerationState", "Transformer", "TransformerLayer", "sinusoid"]
