"""Model-family knowledge (which modules split how). Model files hold no distributed code."""

from ndparallel.models.decoder import DecoderParts, decoder_parts

__all__ = ["DecoderParts", "decoder_parts"]
