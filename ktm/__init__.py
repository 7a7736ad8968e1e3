"""ktm: K-Token Merging — compress long prompts in the latent embedding space."""

from ktm.errors import KTMError
from ktm.prompt import Segment

__version__ = "0.1.0"

__all__ = ["KTMError", "Segment", "__version__"]
