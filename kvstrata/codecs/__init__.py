"""Cold-page codecs, chosen per layer group: ``identity``, ``nvfp4`` (lossy), ``lossless``."""

from .base import (ChecksumError, Codec, CodecError, CodecVersionError, CorruptPageError,
                   EncodedPage, IdentityCodec, UnencodablePageError, available_codecs, crc32,
                   get_codec, register_codec)

__all__ = ["ChecksumError", "Codec", "CodecError", "CodecVersionError", "CorruptPageError",
           "EncodedPage", "IdentityCodec", "UnencodablePageError", "available_codecs", "crc32",
           "get_codec", "register_codec"]
