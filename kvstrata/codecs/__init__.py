"""Cold-page codecs, chosen per layer group: ``identity``, ``nvfp4`` (lossy), ``lossless``.

Importing this package imports every built-in codec module; each registers its codec.
"""

from .base import (ChecksumError, Codec, CodecError, CodecVersionError, CorruptPageError,
                   EncodedPage, IdentityCodec, UnencodablePageError, available_codecs, crc32,
                   get_codec, register_codec)
from .lossless import LosslessCodec
from .measure import CompressionReport, compression_report, synthetic_kv
from .nvfp4 import NVFP4Codec

__all__ = ["ChecksumError", "Codec", "CodecError", "CodecVersionError", "CompressionReport",
           "CorruptPageError", "EncodedPage", "IdentityCodec", "LosslessCodec", "NVFP4Codec",
           "UnencodablePageError", "available_codecs", "compression_report", "crc32",
           "get_codec", "register_codec", "synthetic_kv"]
