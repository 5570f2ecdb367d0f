"""TableConfig: one frozen object per table, built by the modules' keyword arguments or passed
whole; typed storage options, and clear errors for what does not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tieredemb
from ssd_backend import LogOptions, RocksDBOptions, SlotOptions


def test_keyword_arguments_build_the_config_a_module_also_takes_whole(tmp_path):
    cfg = tieredemb.TableConfig(1000, 8, cache_rows="1KiB", host_rows=200, ssd_path=tmp_path / "t",
                                ssd={"backend": "log", "segment_bytes": 1 << 20},
                                optimizer=tieredemb.Adagrad(lr=0.1), seed=3)
    assert cfg.width == 16 and cfg.cache_rows == 1024 // (16 * 4)  # bytes resolved to rows, state counted
    assert cfg.ssd == LogOptions(segment_bytes=1 << 20) and cfg.ssd_path == str(tmp_path / "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_rows = 5
    a = tieredemb.TieredEmbeddingBag(cfg, mode="sum")
    assert a.config is cfg and a.cache_rows == 16 and a.optimizer == tieredemb.Adagrad(lr=0.1)
    a.close()
    b = tieredemb.TieredEmbeddingBag(1000, 8, "sum", cache_rows="1KiB", host_rows=200, ssd_path=tmp_path / "t",
                                     ssd_options={"backend": "log", "segment_bytes": 1 << 20},
                                     optimizer=tieredemb.Adagrad(lr=0.1), seed=3)
    assert b.config == cfg
    b.close()


def test_options_dict_without_a_backend_is_for_the_table_the_directory_holds(tmp_path):
    tieredemb.TieredEmbedding(100, 4, ssd_path=tmp_path / "t", ssd_options={"backend": "slots"}).close()
    cfg = tieredemb.TableConfig(100, 4, ssd_path=tmp_path / "t", ssd={"direct_reads": False})
    assert cfg.ssd == SlotOptions()
    assert tieredemb.TableConfig(100, 4, ssd_path=tmp_path / "new", ssd={"wal": False}).ssd == RocksDBOptions(wal=False)


@pytest.mark.parametrize("options,match", [
    ({"backend": "log", "block_cache_bytes": 1}, r"unknown option 'block_cache_bytes' for the 'log' ssd backend; "
                                                 r"valid options: storage_dtype, direct_reads, io_threads, segment_bytes"),
    ({"backend": "rocksdb", "segment_bytes": 1 << 20, "bogus": 1}, r"unknown options 'bogus', 'segment_bytes' for "
                                                                   r"the 'rocksdb' ssd backend; valid options: "),
    ({"backend": "lmdb"}, r"ssd backend 'lmdb' is not one of \['log', 'rocksdb', 'slots'\]"),
    ({"backend": "log", "io_threads": 0}, r"io_threads 0: must be an int in \[1, 1024\]"),
    ({"backend": "slots", "io_threads": 2000}, r"io_threads 2000: must be an int in \[1, 1024\]"),
    ({"backend": "rocksdb", "compression": "zstd"}, r"compression 'zstd': must be None or 'lz4'"),
    ({"storage_dtype": torch.float64}, r"storage_dtype torch.float64: must be one of"),
    # (a review: the string "false" turned O_DIRECT on, and kept RocksDB's log)
    ({"backend": "log", "direct_reads": "false"}, r"direct_reads 'false': must be True or False"),
    ({"backend": "rocksdb", "wal": "false"}, r"wal 'false': must be True or False"),
    ({"backend": "log", "segment_bytes": 1 << 40}, r"segment_bytes 1099511627776: must be None or an int in "
                                                   r"\[65536, 2\*\*40\)"),
])
def test_bad_storage_options_are_rejected_naming_the_valid_ones(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        tieredemb.TieredEmbeddingBag(100, 4, ssd_path=tmp_path / "t", ssd_options=options)
    assert not (tmp_path / "t").exists()  # nothing was created


def test_bad_table_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"unknown argument cache_size; the table's arguments are: cache_rows, "):
        tieredemb.TieredEmbeddingBag(100, 4, cache_size=10)
    cfg = tieredemb.TableConfig(100, 4)
    with pytest.raises(TypeError, match="a TableConfig holds the whole table; do not also pass cache_rows"):
        tieredemb.TieredEmbeddingBag(cfg, cache_rows=10)
    with pytest.raises(TypeError, match="embedding_dim is required"):
        tieredemb.TieredEmbedding(100)
    with pytest.raises(ValueError, match="ssd options were given without ssd_path"):
        tieredemb.TableConfig(100, 4, ssd=LogOptions())
    with pytest.raises(ValueError, match="host_rows 5 < the 10 rows of tier 0"):
        tieredemb.TableConfig(100, 4, cache_rows=10, host_rows=5)
    with pytest.raises(ValueError, match=r"padding_idx 100 out of range \[-100, 100\)"):
        tieredemb.TableConfig(100, 4, padding_idx=100)
    tieredemb.TieredEmbedding(100, 4, ssd_path=tmp_path / "t", ssd_options=LogOptions()).close()
    with pytest.raises(ValueError, match="holds a 'log' table, requested backend 'rocksdb'"):
        tieredemb.TieredEmbedding(100, 4, ssd_path=tmp_path / "t", ssd_options=RocksDBOptions())


def test_zero_copy_is_for_a_cuda_tier_0_right_above_host_rows(tmp_path):
    with pytest.raises(TypeError, match="zero_copy must be a bool, got 'yes'"):
        tieredemb.TableConfig(100, 4, zero_copy="yes")
    for bad in (dict(cache_rows=10), dict(device="cuda"), dict(device="cuda", cache_rows=100),
                dict(device="cuda", cache_rows=10, ssd_path=tmp_path / "t"),
                dict(device="cuda", cache_rows=10, host_rows=50)):
        with pytest.raises(ValueError, match="zero_copy is for a cuda tier 0 smaller than the table, right above its "
                                             "rows in host memory"):
            tieredemb.TableConfig(100, 4, zero_copy=True, **bad)
    assert not (tmp_path / "t").exists()  # (refused before any store was made)
    for good in (dict(cache_rows=10), dict(cache_rows=10, host_rows=100)):  # (host_rows 100: no host cache)
        assert tieredemb.TableConfig(100, 4, device="cuda", zero_copy=True, **good).zero_copy


def test_cuda_graphs_is_a_bool_and_a_cpu_table_captures_nothing():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got 1"):
        tieredemb.TableConfig(100, 4, cuda_graphs=1)
    emb = tieredemb.TieredEmbeddingBag(100, 4, cuda_graphs=True)  # (the default; graphs are for cuda)
    assert emb.config.cuda_graphs and emb._store.tier0.graphs is None


def test_rows_are_padded_to_a_whole_number_of_row_alignment_bytes_with_zero_words(tmp_path):
    for bad in (0, 2, 3, 6, 96, 8192, True, "128", 128.0):
        with pytest.raises(ValueError, match=f"row_alignment must be a power of two from 4 to 4096 .*got {bad!r}"):
            tieredemb.TableConfig(100, 4, row_alignment=bad)
    rowwise = tieredemb.RowWiseAdagrad(lr=0.1)
    widths = {a: tieredemb.TableConfig(100, 128, optimizer=rowwise, row_alignment=a).width for a in (4, 8, 64, 128)}
    assert widths == {4: 129, 8: 130, 64: 144, 128: 160}
    cfg = tieredemb.TableConfig(100, 8, optimizer=tieredemb.Adam(lr=0.1), row_alignment=128, cache_rows="1KiB",
                                dtype=torch.bfloat16)
    assert (cfg.layout.words, cfg.width, cfg.cache_rows) == (4 + 16, 32, 1024 // 128)  # (sizes count the pad)
    assert cfg.meta()["row_pad"] == 12 and "row_pad" not in tieredemb.TableConfig(100, 8).meta()
    # training and reading see the weights and the state only; every stored row's pad words stay zero
    emb = tieredemb.TieredEmbeddingBag(100, 8, "sum", optimizer=rowwise, cache_rows=10, row_alignment=64)
    ids = torch.randint(0, 100, (60,), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        emb(ids, torch.arange(0, 60, 6)).backward(torch.ones(10, 8))
    assert emb.read_optimizer_state(torch.arange(100)).shape == (100, 1)
    assert (emb.read_optimizer_state(ids) > 0).all()
    emb.flush()
    raw = emb._store.host_store.rows
    assert raw.shape == (100, 16) and (raw[:, 9:] == 0).all() and (raw[ids, 8] > 0).all()


def test_a_store_reopened_with_another_row_alignment_is_refused_and_an_export_imports_across_alignments(tmp_path):
    make = lambda a: tieredemb.TieredEmbeddingBag(  # noqa: E731
        100, 8, "sum", optimizer=tieredemb.Adagrad(lr=0.1), ssd_path=tmp_path / "t", cache_rows=10, row_alignment=a)
    emb = make(4)
    ids = torch.arange(0, 100, 3)
    emb.write_rows(ids, torch.randn(len(ids), 8), torch.rand(len(ids), 8))
    emb.export_rows(tmp_path / "export")
    want = torch.cat([emb.read_rows(torch.arange(100)), emb.read_optimizer_state(torch.arange(100))], 1)
    emb.close()
    with pytest.raises(ValueError, match="stored width 16 != requested 32"):
        make(128)
    make(4).close()  # (the store as it was)
    padded = tieredemb.TieredEmbeddingBag(100, 8, "sum", optimizer=tieredemb.Adagrad(lr=0.1), cache_rows=10,
                                          row_alignment=128)
    assert padded.import_rows(tmp_path / "export") == len(ids)  # (the rows ever written)
    got = torch.cat([padded.read_rows(torch.arange(100)), padded.read_optimizer_state(torch.arange(100))], 1)
    assert torch.equal(got, want)
    other = tieredemb.TieredEmbeddingBag(100, 8, "sum", optimizer=tieredemb.RowWiseAdagrad(lr=0.1), row_alignment=128)
    with pytest.raises(ValueError, match="exported optimizer state width 8 != this table's 1"):
        other.import_rows(tmp_path / "export")
