"""ktm: K-Token Merging — compress long prompts in the latent embedding space."""

from ktm.encoder import EncoderConfig, KTokenEncoder
from ktm.errors import KTMError
from ktm.generate import GenerationConfig
from ktm.model import CompressedPrompt, KTMModel, LoraSettings
from ktm.prompt import Segment
from ktm.train import TrainConfig, train

__version__ = "0.1.0"

__all__ = [
    "CompressedPrompt", "EncoderConfig", "GenerationConfig", "KTMError", "KTMModel",
    "KTokenEncoder", "LoraSettings", "Segment", "TrainConfig", "train", "__version__",
]
