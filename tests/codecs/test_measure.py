"""compression_report and synthetic_kv."""

import pytest
import torch

from kvstrata.codecs import CompressionReport, compression_report, synthetic_kv


def test_reports_for_each_codec():
    pages = synthetic_kv("key", 3, 2, 2, 16, 64, seed=4)
    ident = compression_report(pages, "identity", repeats=1)
    assert ident.ratio == 1.0 and ident.bit_exact and ident.rel_rmse == 0.0
    assert ident.num_pages == 3 and ident.page_shape == (2, 2, 2, 16, 64)
    assert ident.raw_bytes == pages.numel() * 2
    lossless = compression_report(pages, "lossless", repeats=1)
    assert lossless.bit_exact and lossless.ratio > 1.2 and lossless.encode_gbps > 0
    fp4 = compression_report(pages[0], "nvfp4", repeats=1, backend="torch")
    assert not fp4.bit_exact and 3.5 < fp4.ratio < 3.56 and 0.03 < fp4.rel_rmse < 0.105
    assert fp4.options == "backend=torch" and fp4.num_pages == 1
    row = fp4.markdown_row()
    assert row.startswith("| nvfp4 | backend=torch | bfloat16 | 1 | 3.5") and row.count("|") == 12
    assert CompressionReport.MARKDOWN_HEADER.count("\n") == 1
    assert fp4.as_dict()["ratio"] == fp4.ratio


def test_synthetic_kv_shapes_and_structure():
    k = synthetic_kv("key", 4, 2, 2, 16, 128, dtype="fp32", seed=0)
    assert k.shape == (4, 2, 2, 2, 16, 128) and k.dtype == torch.float32
    ch_std = k[:, :, 0].std(dim=(0, 3))  # per (layer, head, channel) std of K
    assert ch_std.max() / ch_std.median() > 8  # outlier channels exist
    assert torch.equal(k, synthetic_kv("key", 4, 2, 2, 16, 128, dtype="fp32", seed=0))
    with pytest.raises(ValueError, match="kind"):
        synthetic_kv("uniform", 1, 1, 1, 1, 16)


def test_bad_input():
    with pytest.raises(ValueError, match="pages must be"):
        compression_report(torch.zeros(2, 3, 16), "identity")
    with pytest.raises(ValueError, match="repeats"):
        compression_report(torch.zeros(1, 2, 1, 1, 16), "identity", repeats=0)
    with pytest.raises(ValueError, match="unknown codec"):
        compression_report(torch.zeros(1, 2, 1, 1, 16), "nope")
