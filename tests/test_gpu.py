"""device='cuda': the device-resident tier 0 on a real GPU. Results equal the CPU path within
float tolerance and are bit for bit the same from run to run; the Triton kernels equal their
torch-ops twin; rows never written are drawn on the GPU bit for bit as on the CPU; a table held
whole in HBM waits for the device at most once per batch. Skipped without a GPU (the same code
runs on CPU tensors in test_gpu_tier.py)."""

import pytest
import torch

import tieredemb
from tieredemb import _C
from training import KJT

pytestmark = pytest.mark.gpu

NUM, DIM = 300, 16
TIERS = [dict(cache_rows=None), dict(cache_rows=100), dict(cache_rows=100, host_rows=150), dict(cache_rows=8)]


def _train(device, mode="mean", opt=lambda: tieredemb.Adagrad(lr=0.1), steps=30, depth=0, padding_idx=5, **tiers):
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode=mode, padding_idx=padding_idx, optimizer=opt(), seed=3,
                                       device=device, **tiers)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, NUM, (64,), generator=g), torch.arange(0, 64, 4), torch.randn(16, DIM, generator=g))
            for _ in range(steps)]
    loader = data if depth == 0 else tieredemb.PrefetchLoader(data, [emb], depth=depth)
    outs = []
    for ids, offsets, grad in loader:
        out = emb(ids, offsets)
        assert out.device.type == torch.device(device).type
        out.backward(grad.to(device))
        outs.append(out.detach().cpu())
    return emb, torch.stack(outs)


def _table(emb):
    ids = torch.arange(NUM)
    return torch.cat([emb.read_rows(ids), emb.read_optimizer_state(ids)], 1)


@pytest.mark.parametrize("tiers", TIERS, ids=["whole", "cache", "host", "overflow"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_cuda_matches_cpu(tiers, mode):
    cpu, out_cpu = _train("cpu", mode, **tiers)
    gpu, out_gpu = _train("cuda", mode, **tiers)
    torch.testing.assert_close(out_gpu, out_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_table(gpu), _table(cpu), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opt", [lambda: tieredemb.SGD(lr=0.1), lambda: tieredemb.RowWiseAdagrad(lr=0.1),
                                 lambda: tieredemb.Adam(lr=0.01),
                                 lambda: tieredemb.RowWiseAdagrad(lr=0.1, weight_decay=0.3),
                                 lambda: tieredemb.Adam(lr=0.01, weight_decay=0.3, weight_decay_mode="decoupled")],
                         ids=["sgd", "rowwise", "adam", "rowwise-l2", "adamw"])
def test_cuda_optimizers_match_cpu(opt):
    cpu, _ = _train("cpu", "sum", opt, cache_rows=60)
    gpu, _ = _train("cuda", "sum", opt, cache_rows=60)
    torch.testing.assert_close(_table(gpu), _table(cpu), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_stochastic_rounding_on_the_gpu_rounds_as_the_cpu(mode, dtype, graphs):
    """16-bit rows rounded stochastically take the native kernels' random bits on the GPU: after
    training, a row's value differs from the CPU engine's only where float32 arithmetic differs
    (fused multiply-adds: a decision flips once in thousands), never by a rule. (ptxas miscompiled
    one lane of four of fp16's rounding in the max-pooling update: every fourth column rounded
    toward zero, a quarter of the columns updated; thirty-fourth session.)"""
    kw = dict(optimizer=tieredemb.SGD(lr=0.1), dtype=dtype, stochastic_rounding=True)
    data = [_shaped(k, 16, 5, short=k) for k in range(6)]
    tables = []
    for device in ("cpu", "cuda"):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode, padding_idx=5, seed=3, device=device,
                                           **(dict(cuda_graphs=graphs) if device == "cuda" else {}), **kw)
        for ids, offsets, grad in data:
            emb(ids, offsets).backward(grad.to(device))
        tables.append(emb.read_rows(torch.arange(NUM)))
    cpu, gpu = tables
    moved = tieredemb.TieredEmbeddingBag(NUM, DIM, mode, seed=3, **kw).read_rows(torch.arange(NUM)) != cpu
    assert moved.sum() > 500  # (the steps changed many values)
    assert (gpu != cpu).sum() <= 0.01 * moved.sum(), ((gpu != cpu).sum(), moved.sum())


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_rowwise_weight_decay_matches_fbgemms_gpu_tbe(mode):
    """FBGEMM's CPU TBE leaves weight_decay out (test_weight_decay.py holds its CUDA rule); its GPU
    TBE applies it: the same weights after 30 steps."""
    tbe_mod = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode

    tbe = tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(NUM, DIM, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8, weight_decay=0.3,
        weight_decay_mode=tbe_mod.WeightDecayMode.L2 if mode == "l2" else tbe_mod.WeightDecayMode.DECOUPLE,
        pooling_mode=PoolingMode.SUM, device="cuda")
    ours, _ = _train("cuda", "sum", lambda: tieredemb.RowWiseAdagrad(lr=0.1, eps=1e-8, weight_decay=0.3,
                                                                     weight_decay_mode=mode),
                     padding_idx=None, cache_rows=60)
    fresh = tieredemb.TieredEmbeddingBag(NUM, DIM, mode="sum", seed=3)  # (the rows as seed 3 draws them, as on cuda)
    tbe.split_embedding_weights()[0].copy_(fresh.read_rows(torch.arange(NUM)).cuda())
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        ids, offsets, grad = torch.randint(0, NUM, (64,), generator=g), torch.arange(0, 64, 4), torch.randn(16, DIM,
                                                                                                         generator=g)
        tbe(ids.cuda(), torch.cat([offsets, torch.tensor([64])]).cuda()).backward(grad.cuda())
    torch.testing.assert_close(ours.read_rows(torch.arange(NUM)), tbe.split_embedding_weights()[0].cpu(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tiers", TIERS, ids=["whole", "cache", "host", "overflow"])
def test_bit_for_bit_from_run_to_run(tiers):
    a, out_a = _train("cuda", "sum", **tiers)
    b, out_b = _train("cuda", "sum", **tiers)
    assert torch.equal(out_a, out_b) and torch.equal(_table(a), _table(b))


@pytest.mark.parametrize("apart, align", [(True, 4), (False, 4), (True, 128)],
                         ids=["write-back-apart", "write-back-inline", "aligned-rows"])
@pytest.mark.parametrize("depth", [0, 2], ids=["plain", "prefetch"])
@pytest.mark.parametrize("cache_rows", [100, 8], ids=["cache", "overflow"])
def test_zero_copy_trains_bit_for_bit_as_the_host_copies(cache_rows, depth, apart, align, monkeypatch):
    """zero_copy: the GPU reads misses from the pinned, mapped host rows and writes dirty victims
    into them (on the tier's stream, a prefetch worker's too; apart: staged, then written down on
    a stream of their own, which the next residency and every read of the host rows wait for);
    the same outputs and rows, bit for bit, as the copies through host blocks, and the same
    counters (the rows' written bits and the store's counters are kept on the device, the store
    told when it is read); rows read and written by the host between batches, and a flush (each
    read waits for the device's writes to the host rows). align: the zero-copy table's rows padded
    to that many bytes (row_alignment; its moves leave the pad out), the copying table's not."""
    from tieredemb.gpu import zerocopy

    monkeypatch.setattr(zerocopy, "WRITE_BACK_APART", apart)
    pad = 5 if depth == 0 else None  # (with prefetch: see _counted_alike)
    # (aligned: row-wise Adagrad's rows of 17 words padded to 32; Adagrad's 32 words would need none)
    opt = (lambda: tieredemb.Adagrad(lr=0.1)) if align == 4 else (lambda: tieredemb.RowWiseAdagrad(lr=0.1))
    plain, out_plain = _train("cuda", "sum", opt, cache_rows=cache_rows, depth=depth, padding_idx=pad)
    mapped, out_mapped = _train("cuda", "sum", opt, cache_rows=cache_rows, depth=depth, padding_idx=pad,
                                zero_copy=True, row_alignment=align)
    assert mapped._store.tier0.zero_copy is not None and mapped.stats()["store"]["rows_written"] > 0
    assert (mapped.layout.pad > 0) == (align != 4)
    _counted_alike(mapped, plain, depth, moved_only=True)
    assert torch.equal(out_mapped, out_plain) and torch.equal(_table(mapped), _table(plain))
    for emb in (plain, mapped):  # a flush, host writes below tier 0, then more training over them
        emb.flush()
        emb.write_rows(torch.arange(0, NUM, 3), torch.full((len(range(0, NUM, 3)), DIM), 0.5))
        if emb is mapped and align != 4:  # (its pad words spoiled on purpose: the moves must not carry them)
            emb._store.tier0.pool.rows[:, emb.layout.words:] = 7.0
            torch.cuda.synchronize()  # (before the next residency, on the tier's stream, moves them or not)
        emb(torch.arange(NUM), torch.arange(0, NUM, 10)).sum().backward()
    assert torch.equal(_table(mapped), _table(plain))
    assert (mapped._store.host_store.rows[:, mapped.layout.words:] == 0).all()
    _counted_alike(mapped, plain, depth, moved_only=False)
    mapped.close()


def _counted_alike(a, b, depth: int, moved_only: bool) -> None:
    """a and b, trained on the same batches, counted the same. Without prefetch: every counter of
    the store. With a PrefetchLoader, which rows tier 0 holds at each step depends on the worker's
    timing (whether a batch fits beside those in flight or waits for room), and so do misses,
    write-backs and the store's counters: three runs of the copying table alone, on CPU tensors,
    read 786, 804 and 814 rows (on the H200 the zero-copy table read 820, the copying one 821).
    Then: both drew the same rows on first touch (reads - rows_found), and where the store was
    moved to and from by tier 0 alone (moved_only), each store counted a read per miss of its tier
    0 and a write per dirty write-back: the zero-copy table's counts, kept on the device. (Rows
    drawn: every row read and never written, each time it is read. A padding row is never updated,
    so it may leave tier 0 clean and be drawn again, as often as timing has it evict it: the
    prefetch case trains without one, and every row is drawn once, on first touch.)"""
    sa, sb = a.stats(), b.stats()
    if depth == 0:
        assert sa["store"] == sb["store"], (sa["store"], sb["store"])
        return
    drawn = [s["store"]["reads"] - s["store"]["rows_found"] for s in (sa, sb)]
    assert drawn[0] == drawn[1] > 0, (sa["store"], sb["store"])
    for s in (sa, sb) if moved_only else ():
        assert (s["store"]["reads"], s["store"]["rows_written"]) == \
            (s["tier0"]["misses"], s["tier0"]["dirty_writebacks"]), (s["store"], s["tier0"])


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copies", "zero-copy"])
def test_kernels_capped_at_a_few_programs_train_bit_for_bit_as_one_per_item(monkeypatch, zero_copy):
    """The update, assign, misses' draw and zero-copy's move kernels, each capped at 7 programs
    that take their items (the draw and the moves: chunks of rows) 7 apart
    (pooling.UPDATE_PROGRAMS, plan_kernels.ASSIGN_PROGRAMS, rowinit.INIT_PROGRAMS,
    moves.MOVE_PROGRAMS, zerocopy.WRITE_BACK_PROGRAMS; by default a few per multiprocessor),
    train the same bits as one program per item (a chunk)."""
    from tieredemb.gpu import moves, plan_kernels, pooling, rowinit, zerocopy

    caps = ((pooling, "UPDATE_PROGRAMS"), (plan_kernels, "ASSIGN_PROGRAMS"), (rowinit, "INIT_PROGRAMS"),
            (moves, "MOVE_PROGRAMS"), (zerocopy, "WRITE_BACK_PROGRAMS"))
    for module, name in caps:
        monkeypatch.setattr(module, name, None)
    plain, out_plain = _train("cuda", "sum", cache_rows=8, zero_copy=zero_copy)
    for module, name in caps:
        monkeypatch.setattr(module, name, 7)
    capped, out_capped = _train("cuda", "sum", cache_rows=8, zero_copy=zero_copy)
    assert torch.equal(out_capped, out_plain) and torch.equal(_table(capped), _table(plain))


def test_a_move_into_mapped_host_rows_gets_the_programs_of_the_whole_gpu():
    """A move that writes pinned host rows (a CPU tensor to torch) runs on the GPU of its other side,
    with that GPU's programs per multiprocessor, as a move that reads them does."""
    from tieredemb.gpu import PerMultiprocessor, moves, multiprocessors

    pool, host = torch.zeros(64, 4, device="cuda"), torch.zeros(64, 4).pin_memory()
    sms, blocks = multiprocessors(pool.device), 1 << 20
    assert moves._grid(blocks * moves.MOVE_ROWS, pool, host) == (moves.MOVE_PROGRAMS.count * sms,)
    assert moves._grid(blocks * moves.MOVE_ROWS, host, pool) == (moves.MOVE_PROGRAMS.count * sms,)
    assert moves._grid(blocks * moves.MOVE_ROWS, pool, host, PerMultiprocessor(2)) == (2 * sms,)


def test_a_queued_store_call_runs_in_stream_order_between_the_work_around_it(tmp_path):
    """The log store's StreamIo (gpu/storeio.py) queued on a busy stream: the call reads the plan's
    transfer the stream copied to the host before it, and the copy to the device after it sees the
    rows it read (a row never written marked), and the rows it wrote down are the store's."""
    from ssd_backend.log_store import LogStore
    from tieredemb.gpu import plan_kernels, storeio
    from tieredemb.tiers.rowstore import DEFERRED_MARK

    store = LogStore(tmp_path / "t", 4, lambda i, o, r=None: o.zero_() if r is None else o.index_fill_(0, r, 0.0),
                     {"num_embeddings": 100})
    rows = torch.arange(40.0).view(10, 4)
    store.write_from(torch.arange(10), rows, torch.arange(10))
    io, k = storeio.stream_io(store), plan_kernels.KINDS
    xfer = torch.zeros(k + 6, dtype=torch.int64)
    xfer[plan_kernels.FRESH], xfer[plan_kernels.DIRTY] = 3, 2
    xfer[k:k + 3], xfer[k + 3:k + 5] = torch.tensor([2, 7, 50]), torch.tensor([60, 61])  # (misses, then victims)
    xfer = xfer.cuda()
    lists = torch.zeros(k + 6, dtype=torch.int64, pin_memory=True)
    out, into = torch.full((3, 4), 5.0, pin_memory=True), torch.zeros(3, 4, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # (xfer's values first)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # (the stream busy for a while: the call must wait for the copy)
        lists.copy_(xfer, non_blocking=True)
        io.queue(stream.cuda_stream, lists, 3, out.view(torch.uint8), into.view(torch.uint8))
        after = into.to("cuda", non_blocking=True)
    stream.synchronize()
    assert io.error() == "" and torch.equal(after[:2].cpu(), rows[[2, 7]])
    assert after[2].cpu().view(torch.int32)[0] == DEFERRED_MARK
    counts = io.take_counts()
    assert (counts["calls"], counts["reads"], counts["rows_found"], counts["rows_marked"], counts["rows_written"]) == \
        (1, 3, 2, 1, 2)
    got = torch.empty(2, 4)
    store.read(torch.tensor([60, 61]), got)
    assert (got == 5.0).all()
    store.close()


def test_a_bare_cuda_device_names_the_gpu_current_at_creation():
    """device="cuda" is fixed to the GPU current when the table is made (as torch's modules take
    it): its stream and its waits then never follow whichever GPU a later caller has current."""
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=100, device="cuda")
    assert emb.device == torch.device("cuda", torch.cuda.current_device())
    assert emb._store.tier0.stream.device == emb.device
    emb.close()


def test_release_events_do_not_pile_up_while_a_prefetcher_waits_for_its_plans():
    """A zero-copy table fed by a prefetcher makes every batch resident with a plan that waits (not
    allowed overflow: no queued residency), and every release leaves an event for a queued one to
    wait for: the ones the device has done are dropped, not kept for ever."""
    # (100 rows: the next batch fits beside the one in flight, so the worker plans it while that one is held)
    emb, _ = _train("cuda", "sum", cache_rows=100, zero_copy=True, depth=2, steps=40)
    assert len(emb._store.tier0.zero_copy.releases_since) <= 4  # (those after the last plan; else up to one a batch)


def test_zero_copy_tables_made_and_closed_again_and_again():
    """close() unregisters the host rows (a table made after at the same address registers
    anew), and a forked child gets no copy of the pinned rows (MADV_DONTFORK) yet runs."""
    import os

    for _ in range(3):
        emb = tieredemb.TieredEmbeddingBag(10_000, 64, cache_rows=100, device="cuda", zero_copy=True,
                                           optimizer=tieredemb.SGD(lr=0.1))
        emb(torch.arange(300), torch.arange(0, 300, 3)).sum().backward()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        emb.close()


def _assert_the_worker_made_batches_resident(emb) -> None:
    """The prefetch worker made every batch resident, none its forward: ahead of the forward, or
    while the forward waited for it (which of the two is timing: on an H200 a run of 12 small
    batches of device ids had every batch late, and prefetched_rows > 0 failed)."""
    p = emb.stats()["prefetch"]
    assert p["registered"] == p["forwards"] > 0 and p["demand_misses"] == 0, p  # (every forward's batch registered)
    assert p["prefetched_rows"] + p["late_rows"] > 0, p


def test_prefetch_over_ssd_gives_the_same_weights(tmp_path):
    # (tier 0 of 150 rows: 5 sets of 32, where two batches in a row fit; at 50, two sets, the next
    # batch fits only once the last is released, and its forward then usually comes first)
    plain, out_plain = _train("cuda", "sum", cache_rows=150, ssd_path=tmp_path / "a", ssd_options={"backend": "log"})
    ahead, out_ahead = _train("cuda", "sum", cache_rows=150, ssd_path=tmp_path / "b", ssd_options={"backend": "log"},
                              depth=2)
    assert torch.equal(out_plain, out_ahead) and torch.equal(_table(plain), _table(ahead))
    _assert_the_worker_made_batches_resident(ahead)


@pytest.mark.parametrize("depth", [0, 2], ids=["plain", "prefetch"])
@pytest.mark.parametrize("cache_rows", [150, 8], ids=["cache", "overflow"])
def test_the_store_read_in_stream_order_gives_the_same_weights(tmp_path, monkeypatch, cache_rows, depth):
    """gpu/storeio.py: the log store read and written by calls queued on tier 0's stream (StreamIo)
    trains the same bits as the waiting path, and counts the same store work."""
    from tieredemb.gpu import storeio

    ssd = dict(ssd_options={"backend": "log"})
    plain, out_plain = _train("cuda", "sum", cache_rows=cache_rows, ssd_path=tmp_path / "a", **ssd)
    monkeypatch.setattr(storeio, "ON_STREAM", True)
    streamed, out_streamed = _train("cuda", "sum", cache_rows=cache_rows, ssd_path=tmp_path / "b", depth=depth, **ssd)
    on_stream = streamed._store.tier0.on_stream
    assert on_stream is not None and on_stream.queued_calls > 0 and on_stream.io.error() == ""
    assert torch.equal(out_plain, out_streamed) and torch.equal(_table(plain), _table(streamed))
    streamed.flush()
    plain.flush()
    st, st_plain = streamed.stats(), plain.stats()
    assert st["ssd"]["rows_written"] > 0 and st["ssd"]["reads"] > 0
    if depth == 0:  # (with prefetch the batches are made resident at other times: other victims)
        assert st["ssd"] == st_plain["ssd"]


def test_rows_never_written_are_drawn_on_the_gpu_as_on_the_cpu():
    from tieredemb.gpu import rowinit

    ids = torch.tensor([0, 1, 5, 12345, 10**9, 2**40, 7])
    for kind, a, b in [(0, 0.0, 1.0), (1, -0.5, 0.25)]:
        for dim, width in [(16, 17), (128, 129), (5, 7)]:
            want = torch.empty(len(ids), width)
            _C.init_rows(ids, want, dim, kind, a, b, 42, 7)
            got = torch.full((len(ids), width), 9.0, device="cuda")
            rowinit.init_rows(ids.cuda(), got, None, dim, kind, a, b, 42, 7)
            assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), (kind, dim)
    big = tieredemb.TieredEmbeddingBag(10**9, DIM, "sum", cache_rows=1000, device="cuda", seed=4)
    ref = tieredemb.TieredEmbeddingBag(10**9, DIM, "sum", cache_rows=1000, seed=4)
    ids = torch.tensor([3, 10**9 - 1, 123456789])
    with torch.no_grad():
        assert torch.equal(big(ids, torch.arange(3)).cpu(), ref(ids, torch.arange(3)))


def test_triton_kernels_equal_the_torch_twin(monkeypatch):
    import tieredemb.kernels

    triton_run, _ = _train("cuda", "max", cache_rows=60)
    monkeypatch.setattr(tieredemb.kernels, "implementation", lambda pool: "torch")
    twin, _ = _train("cuda", "max", cache_rows=60)
    torch.testing.assert_close(_table(triton_run), _table(twin), rtol=1e-5, atol=1e-6)


def test_whole_table_in_hbm_waits_for_the_device_at_most_once_per_batch(monkeypatch):
    """Host ids and offsets (as a data loader gives them): the whole-table tier initializes its
    misses on the GPU, so training never waits for the device."""
    waits = []
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        original = owner.synchronize
        monkeypatch.setattr(owner, "synchronize", lambda self, _o=original: (waits.append(1), _o(self))[1])
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), device="cuda")
    ids, offsets = torch.randint(0, NUM, (64,)), torch.arange(0, 64, 4)
    torch.cuda.set_sync_debug_mode("error")  # an implicit wait (.item(), nonzero ...) raises
    try:
        for _ in range(5):
            emb(ids, offsets).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(waits) == 0


def _steps_while_busy(step, steps: int = 3) -> bool:
    """Whether `steps` calls of step() return while the device is still busy with work queued
    before them (about a second of one kernel on the current stream)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's clock
    busy = torch.cuda.Event()
    busy.record()
    for _ in range(steps):
        step()
    still_busy = not busy.query()
    torch.cuda.synchronize()
    return still_busy


@pytest.mark.parametrize("kind", ["module", "collection"])
def test_host_inputs_leave_the_host_running_ahead_of_a_busy_device(monkeypatch, kind):
    """Whole tables given host ids and offsets queue training steps (forward, backward, update)
    without waiting for the device, including the waits torch's sync debug mode cannot see: CUDA
    may drain the stream before a copy of more than 64 KB from pageable host memory
    (cudaMemcpyAsync's documented behaviour), so such inputs go through pinned memory
    (gpu.to_device). With the device held busy by earlier work, three steps return before that
    work is done. The offsets (80 KB, copied on the busy stream in forward and backward) and the
    ids (160 KB, on the tier's stream) are past that size. Also reported, as a warning: whether
    the same steps with plain pageable copies waited on this driver (what the pinning avoids)."""
    import warnings

    n = 20_000
    if kind == "module":
        model = tieredemb.TieredEmbeddingBag(100_000, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), device="cuda")
    else:
        model = tieredemb.TieredEmbeddingBagCollection(
            [tieredemb.EmbeddingBagConfig("a", 100_000, DIM, ["fa"]), tieredemb.EmbeddingBagConfig("b", 50_000, 8, ["fb"])],
            optimizer=tieredemb.SGD(lr=0.1), device="cuda")
    g = torch.Generator().manual_seed(5)
    offsets = torch.arange(0, n, 2)

    def step():
        ids = torch.randint(0, 50_000, (n,), generator=g)
        out = model(ids, offsets) if kind == "module" else model({"fa": (ids, offsets), "fb": (ids, offsets)}).values()
        out.sum().backward()

    step()  # (the kernels compiled)
    _steps_while_busy(step)  # (the device and pinned pools grown to what steps queued behind a busy device take)
    assert _steps_while_busy(step)

    def pageable(t, device, dtype=None):
        return t.to(device, dtype, non_blocking=True)

    from tieredemb import collection, kernels, lookup
    from tieredemb.gpu import checks, tier

    for module in (kernels, lookup, collection, tier, checks):
        monkeypatch.setattr(module, "to_device", pageable)
    _steps_while_busy(step)
    waited = not _steps_while_busy(step)
    warnings.warn(f"with pageable copies instead, the host {'waited' if waited else 'did not wait'} for the busy "
                  f"device ({kind})")


def test_a_cached_table_waits_for_the_device_once_per_batch(monkeypatch):
    """Host ids, tier 0 of a third of the rows, no prefetch: the plan's one transfer (which also
    carries the dirty victims' rows) is the only wait of a training step."""
    waits = []
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        original = owner.synchronize
        monkeypatch.setattr(owner, "synchronize", lambda self, _o=original: (waits.append(1), _o(self))[1])
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=100,
                                       device="cuda")
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        emb(torch.randint(0, NUM, (64,), generator=g), torch.arange(0, 64, 4)).sum().backward()
    torch.cuda.synchronize()
    assert len(waits) == 10 and emb._store.tier0.bytes_out > 0


def test_prefetch_keeps_the_training_thread_from_waiting_for_the_device(monkeypatch):
    """Host ids through a PrefetchLoader of depth 2 over a tier 0 of a third of the rows: the
    worker waits for the device (its plan's one transfer, and the dirty victims' rows), on the
    tier's stream; the training thread never waits."""
    import threading

    waits = []
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        original = owner.synchronize
        monkeypatch.setattr(owner, "synchronize",
                            lambda self, _o=original: (waits.append(threading.current_thread().name), _o(self))[1])
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=100,
                                       device="cuda")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, NUM, (64,), generator=g), torch.arange(0, 64, 4)) for _ in range(12)]
    with tieredemb.PrefetchLoader(data, [emb], depth=2) as loader:
        for ids, offsets in loader:
            emb(ids, offsets).sum().backward()
    torch.cuda.synchronize()
    assert set(waits) == {"tieredemb-prefetch"}  # (not the training thread, nor autograd's, which runs the backward)
    assert 0 < len(waits) <= 3 * len(data)  # (a plan each try: the first, and one after each release it waits for)
    _assert_the_worker_made_batches_resident(emb)


def test_clock_is_refused_on_cuda():
    with pytest.raises(ValueError, match="policy 'clock' is not one a GPU tier 0 has"):
        tieredemb.TieredEmbeddingBag(NUM, DIM, cache_rows=50, policy="clock", device="cuda")


def test_cuda_embedding_and_flush():
    emb = tieredemb.TieredEmbedding(NUM, DIM, cache_rows=50, host_rows=80, optimizer=tieredemb.SGD(lr=0.5),
                                    device="cuda")
    ids = torch.randint(0, NUM, (4, 7), device="cuda")
    out = emb(ids)
    assert out.shape == (4, 7, DIM) and out.is_cuda
    out.sum().backward()
    emb.flush()
    assert emb.stats()["tier0"]["misses"] > 0


def test_a_collection_on_cuda_trains_as_on_the_cpu_with_each_tables_share():
    tables = [tieredemb.EmbeddingBagConfig("a", 200, DIM, ["fa"]), tieredemb.EmbeddingBagConfig("b", 100, DIM, ["fb"])]
    runs = {}
    for device in ("cpu", "cuda"):
        ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes=4 * DIM * 4 * 60, device=device,
                                                     optimizer=tieredemb.Adagrad(lr=0.1))
        g = torch.Generator().manual_seed(0)
        outs = []
        for _ in range(10):
            feats = {"fa": (torch.randint(0, 200, (40,), generator=g), torch.arange(0, 40, 4)),
                     "fb": (torch.randint(0, 100, (40,), generator=g), torch.arange(0, 40, 4))}
            out = ebc(feats).values()
            out.square().sum().backward()
            outs.append(out.detach().cpu())
        runs[device] = (torch.stack(outs), ebc.read_rows("a", torch.arange(200)), ebc.stats()["tables"])
    torch.testing.assert_close(runs["cuda"][0], runs["cpu"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs["cuda"][1], runs["cpu"][1], rtol=1e-5, atol=1e-5)
    for t in ("a", "b"):  # each table counted in its own part (set-associative on the GPU: other hits)
        got, want = runs["cuda"][2][t]["tier0"], runs["cpu"][2][t]["tier0"]
        assert got["hits"] + got["misses"] == want["hits"] + want["misses"]


def test_the_cpu_tensor_tests_pass_in_a_child():
    """The tests marked `interpreted` (the GPU path on CPU tensors, its kernels under Triton's
    interpreter) are skipped in this process, where the kernels compile: here they run in a child
    process that sees no GPU, as on a machine without one."""
    import os
    import re
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpreted",
                              here], cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        raise AssertionError(f"the child ran past 30 minutes:\n{out[-3000:]}") from None
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert re.search(r"\b\d+ passed\b", (run.stdout.splitlines() or [""])[-1]), tail


def test_empty_batches_of_cuda_ids():
    """Ids given on the GPU, a batch with none (every bag empty): a whole-table tier, a cached one,
    and one fed through a PrefetchLoader; zero rows out, and nothing changes."""
    for tiers in (dict(cache_rows=None), dict(cache_rows=100)):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), device="cuda", **tiers)
        none, offsets = torch.empty(0, dtype=torch.int64, device="cuda"), torch.zeros(4, dtype=torch.int64)
        out = emb(none, offsets)
        assert out.shape == (4, DIM) and not out.any()
        out.sum().backward()
        data = [(none, offsets), (torch.arange(8, device="cuda"), torch.arange(0, 8, 2)), (none, offsets)]
        with tieredemb.PrefetchLoader(data, [emb], depth=2) as loader:
            for ids, offs in loader:
                emb(ids, offs).sum().backward()
        assert emb.stats()["tier0"]["hits"] + emb.stats()["tier0"]["misses"] == 8


def test_a_collection_takes_features_on_either_device():
    """Ids from the host and the GPU in one batch, per-sample weights on the GPU for one feature
    only; an unpooled collection's inverse-keyed feature with its inverse on the GPU: the same
    results as with everything on the host."""
    tables = [tieredemb.EmbeddingBagConfig("a", 200, DIM, ["fa"]), tieredemb.EmbeddingBagConfig("b", 100, DIM, ["fb"])]
    ebc = tieredemb.TieredEmbeddingBagCollection(tables, device="cuda")
    ids_a, ids_b, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2])
    w = torch.tensor([0.5, 1.0, 2.0, -1.0])
    with torch.no_grad():
        mixed = ebc({"fa": (ids_a.cuda(), offsets, w.cuda()), "fb": (ids_b, offsets)}).values()
        host = ebc({"fa": (ids_a, offsets, w), "fb": (ids_b, offsets)}).values()
    torch.testing.assert_close(mixed, host)
    unpooled = [tieredemb.EmbeddingConfig("u", 50, 4, ["fu"])]
    ec = tieredemb.TieredEmbeddingCollection(unpooled, device="cuda")
    keyed = tieredemb.InverseKeyed(torch.tensor([3, 4, 5]), torch.tensor([0, 2]), torch.tensor([1, 0, 1]))
    on_gpu = tieredemb.InverseKeyed(keyed.values, keyed.offsets, keyed.inverse.cuda())
    with torch.no_grad():
        a, b = ec({"fu": keyed})["fu"], ec({"fu": on_gpu})["fu"]
    torch.testing.assert_close(a.values(), b.values())
    assert a.lengths().tolist() == b.lengths().tolist() == [1, 2, 1]


def _waits(monkeypatch):
    """A list filled with the name of the thread of each wait of the host for the device: the
    implicit ones (.item(), a copy to the host, a stream's synchronize: torch's sync debug mode warns
    of each) and Event.synchronize. Use inside _warned_waits(). (A CUDA backward runs on autograd's
    own thread: the training side is every thread but the prefetch worker, "tieredemb-prefetch".)"""
    import threading

    waits = []
    original = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize",
                        lambda self: (waits.append(threading.current_thread().name), original(self))[1])
    return waits


class _warned_waits:
    def __init__(self, waits):
        self.waits = waits

    def __enter__(self):
        import threading
        import warnings

        self.caught = warnings.catch_warnings()
        self.caught.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: (
            self.waits.append(threading.current_thread().name) if "synchroniz" in str(message) else None)
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self.caught.__exit__(*exc)


def _device_batches(include_last_offset: bool, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, NUM, (64,), generator=g)
        offsets = torch.arange(0, 64 + (1 if include_last_offset else 0), 4)
        if include_last_offset:  # (ids after the last bag: no bag's, not even checked)
            ids, offsets[-1] = torch.cat([ids, torch.tensor([NUM + 7, 3])]), 64
        out.append((ids.cuda(), offsets.cuda(), torch.randn(16, DIM, generator=g).cuda()))
    return out


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("cache_rows", [None, 100])
def test_ids_and_offsets_on_the_gpu_cost_one_wait_a_batch(monkeypatch, cache_rows, include_last_offset):
    """Ids and offsets given on the GPU: checked there, the verdict read in the plan's one
    transfer (a cached tier 0) or with one read (a new table whole in HBM, which draws its rows on
    the device): one wait a step, as host inputs take at most."""
    waits = _waits(monkeypatch)
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=cache_rows,
                                       include_last_offset=include_last_offset, device="cuda")
    data = _device_batches(include_last_offset, 10)
    emb(*data[0][:2]).sum().backward()  # (the kernels compiled)
    torch.cuda.synchronize()
    with _warned_waits(waits):
        for ids, offsets, grad in data[1:]:
            emb(ids, offsets).backward(grad)
    assert len(waits) == len(data) - 1


@pytest.mark.parametrize("cache_bytes", [None, 4 * DIM * 4 * 60], ids=["whole", "cached"])
@pytest.mark.parametrize("keyed", [False, True], ids=["dict", "kjt"])
def test_a_collections_features_on_the_gpu_cost_no_wait_of_their_own(monkeypatch, cache_bytes, keyed):
    """A collection's features given on the GPU are range-checked there, each in its own table,
    by one launch for them all, the verdict read by the first group's residency: the same waits a
    step as the same features from the host, but for the new whole tables' one read of the verdict
    (host ids need none there). A KeyedJaggedTensor's lengths must be read to cut it into
    features: its verdict is read with them, so it costs one wait more than from the host, whole
    tables or cached (two for whole tables before)."""
    tables = [tieredemb.EmbeddingBagConfig("a", 200, DIM, ["fa"]), tieredemb.EmbeddingBagConfig("b", 100, DIM, ["fb"]),
              tieredemb.EmbeddingBagConfig("c", 100, 8, ["fc"])]
    rows = {"fa": 200, "fb": 100, "fc": 100}
    g = torch.Generator().manual_seed(0)
    data = [{f: torch.randint(0, n, (40,), generator=g) for f, n in rows.items()} for _ in range(8)]

    def given(feats, on_gpu):  # (made before the waits are counted: a copy to the GPU waits too)
        if keyed:
            values, lengths = torch.cat(list(feats.values())), torch.full((30,), 4)
            return KJT(list(rows), values.cuda(), lengths.cuda()) if on_gpu else KJT(list(rows), values, lengths)
        return {f: (ids.cuda() if on_gpu else ids, torch.arange(0, 40, 4)) for f, ids in feats.items()}

    counted = {}
    for on_gpu in (False, True):
        batches = [given(feats, on_gpu) for feats in data]
        waits = _waits(monkeypatch)
        ebc = tieredemb.TieredEmbeddingBagCollection(tables, cache_bytes=cache_bytes, device="cuda",
                                                     optimizer=tieredemb.SGD(lr=0.1))
        ebc(batches[0]).values().square().sum().backward()  # (the kernels compiled)
        torch.cuda.synchronize()
        with _warned_waits(waits):
            for batch in batches[1:]:
                ebc(batch).values().square().sum().backward()
        counted[on_gpu] = len(waits) / (len(data) - 1)
        monkeypatch.undo()
    assert counted[True] == counted[False] + ((cache_bytes is None) or keyed), counted


def test_prefetched_ids_and_offsets_on_the_gpu_leave_the_training_thread_waiting_for_nothing(monkeypatch):
    """Through a PrefetchLoader of depth 2: the worker reads each batch's verdict with its plan;
    the training side never waits (its forwards recognize the prefetched tensors by identity)."""
    waits = _waits(monkeypatch)
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), cache_rows=100,
                                       include_last_offset=True, device="cuda")
    data = _device_batches(True, 12)
    with _warned_waits(waits), tieredemb.PrefetchLoader(data, [emb], depth=2) as loader:
        for ids, offsets, grad in loader:
            emb(ids, offsets).backward(grad)
    torch.cuda.synchronize()
    assert waits and set(waits) == {"tieredemb-prefetch"}
    _assert_the_worker_made_batches_resident(emb)


@pytest.mark.parametrize("cache_rows", [None, 100])
def test_ids_and_offsets_on_the_gpu_train_bit_for_bit_as_host_ones(cache_rows):
    """The same batches given on the host and on the GPU (ids after the last bag among them):
    the same outputs, rows and state, bit for bit; a bad batch on the GPU raises the host's error."""
    runs = []
    for on_gpu in (False, True):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "mean", optimizer=tieredemb.Adam(lr=0.05), cache_rows=cache_rows,
                                           include_last_offset=True, device="cuda", seed=4)
        outs = []
        for ids, offsets, grad in _device_batches(True, 8, seed=3):
            if not on_gpu:
                ids, offsets = ids.cpu(), offsets.cpu()
            out = emb(ids, offsets)
            out.backward(grad)
            outs.append(out.detach().cpu())
        runs.append((torch.stack(outs), _table(emb)))
        with pytest.raises(ValueError, match=r"offsets must be non-decreasing: offsets\[2\] = 1 < offsets\[1\] = 3"):
            emb(torch.arange(4, device="cuda"), torch.tensor([0, 3, 1, 4], device="cuda"))
        with pytest.raises(IndexError, match=rf"id {NUM} out of range \[0, {NUM}\)"):
            emb(torch.tensor([1, NUM], device="cuda"), torch.tensor([0, 1, 2], device="cuda"))
        assert torch.equal(_table(emb), runs[-1][1])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_bad_id_prefetched_on_the_gpu_raises_at_its_forward():
    """prefetch() of CUDA ids does not wait for their check: a bad id raises at that batch's
    forward, the host's error, nothing changed; unpooled lookups (no offsets) and bags alike."""
    for emb, bad in (
            (tieredemb.TieredEmbedding(NUM, DIM, optimizer=tieredemb.SGD(lr=0.1), cache_rows=100, device="cuda"),
             (torch.tensor([[1, NUM + 2]], device="cuda"),)),
            (tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.SGD(lr=0.1), device="cuda"),
             (torch.tensor([1, NUM + 2], device="cuda"), torch.tensor([0, 1], device="cuda")))):
        before = _table(emb)
        emb.prefetch(*bad)
        with pytest.raises(IndexError, match=rf"id {NUM + 2} out of range \[0, {NUM}\)"):
            emb(*bad)
        assert torch.equal(_table(emb), before)


def _shaped(seed, bags, length, short=0):
    """A batch of `bags` bags of `length` ids, the first `short` ids shorter (ids, offsets, grad)."""
    g = torch.Generator().manual_seed(seed)
    n = bags * length - short
    return ((torch.rand(n, generator=g) ** 2 * NUM).long(),
            torch.cat([torch.tensor([0]), torch.arange(length - short, n, length)]), torch.randn(bags, DIM, generator=g))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("opt", ["rowwise", "adam", "fp16-stochastic"])
def test_cuda_graphs_train_bit_for_bit_as_kernels_launched_one_by_one(mode, opt):
    """A whole table in HBM replays CUDA graphs of its lookups (gpu/graphed.py): the outputs,
    rows and counters are those of cuda_graphs=False, bit for bit, through ids that vary in
    number within a shape (padded), a change of shape,
    two forwards before one backward, a forward without a graph and a bad id (refused, nothing
    changed); and the graphs were captured and replayed (none failed)."""
    kw = dict(rowwise=dict(optimizer=tieredemb.RowWiseAdagrad(lr=0.1)), adam=dict(optimizer=tieredemb.Adam(lr=0.05)),
              **{"fp16-stochastic": dict(optimizer=tieredemb.SGD(lr=0.1), dtype=torch.float16,
                                         stochastic_rounding=True)})[opt]
    # (16 bags of 77-80 ids share one shape: padded to 80)
    data = [_shaped(k, 16, 5, short=k) for k in range(4)] + [_shaped(10 + k, 7, 3) for k in range(4)] + [_shaped(20, 16, 5)]
    runs, tables = [], []
    for graphs in (True, False):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, mode, padding_idx=5, seed=3, device="cuda", cuda_graphs=graphs,
                                           **kw)
        outs = []
        for ids, offsets, grad in data:
            out = emb(ids, offsets)
            out.backward(grad.cuda())
            outs.append(out.detach())
        (ids, offsets, grad), (ids2, offsets2, grad2) = data[0], data[1]
        first, second = emb(ids, offsets), emb(ids2, offsets2)  # (the second before the first's backward)
        (first * grad.cuda()).sum().add((second * grad2.cuda()).sum()).backward()
        with torch.no_grad():
            outs += [first.detach(), second.detach(), emb(ids, offsets)]
        before = _table(emb)
        with pytest.raises(IndexError, match=rf"id {NUM} out of range \[0, {NUM}\)"):
            emb(torch.cat([ids[:-1], torch.tensor([NUM])]), offsets)
        assert torch.equal(_table(emb), before)
        stats = emb.stats()
        stats["prefetch"].pop("wait_seconds")
        runs.append((torch.cat(outs).cpu(), _table(emb), stats))
        tables.append(emb)
    (got, got_rows, got_stats), (want, want_rows, want_stats) = runs
    assert torch.equal(got, want) and torch.equal(got_rows, want_rows) and got_stats == want_stats
    graphs = tables[0]._store.tier0.graphs.stats()
    assert graphs["failed"] is None and graphs["shapes"] == 2 and graphs["captures"] == 4
    assert tables[1]._store.tier0.graphs is None


def test_cuda_graphs_take_a_learning_rate_set_every_step():
    """An LR schedule (set_learning_rate each step) replays one backward graph that reads the rate
    from the device: the rows those of cuda_graphs=False bit for bit, two captures in all."""
    data = [_shaped(k, 16, 5) for k in range(6)]
    rows = []
    for graphs in (True, False):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", seed=3, device="cuda", cuda_graphs=graphs,
                                           optimizer=tieredemb.RowWiseAdagrad(lr=0.1))
        for step, (ids, offsets, grad) in enumerate(data):
            emb.set_learning_rate(0.1 / (step + 1))
            emb(ids, offsets).backward(grad.cuda())
        rows.append(_table(emb))
        if graphs:
            stats = emb._store.tier0.graphs.stats()
            assert stats["failed"] is None and stats["captures"] == 2 and stats["replays"] >= 4
    assert torch.equal(rows[0], rows[1])


def test_cuda_graphs_of_a_zero_copy_table_train_bit_for_bit_as_kernels_launched_one_by_one():
    """A zero-copy tier 0 (10 % of the rows) replays CUDA graphs of its lookups: the queued
    residency (plan, rows moved through the mapped host rows, commit, pins), the pooling, the
    update and the release. Outputs, rows and counters are cuda_graphs=False's, bit for bit,
    through a change of shape, two batches of the same ids in flight (the second replayed), a
    forward under no_grad, and a batch wider than the overflow slots while a replayed batch
    awaits its backward (the tier grows; the shape is captured again); every pin released."""
    small = [_shaped(k, 16, 5) for k in range(4)]
    other = [_shaped(10 + k, 7, 3) for k in range(3)]
    wide = _shaped(20, 60, 20)  # (1200 ids: more than the 1024 overflow slots a tier starts with)
    runs, made = [], []
    for graphs in (True, False):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", optimizer=tieredemb.Adam(lr=0.05), cache_rows=30, seed=3,
                                           device="cuda", zero_copy=True, cuda_graphs=graphs)
        outs = []
        for ids, offsets, grad in small + other + small:
            out = emb(ids, offsets)
            out.backward(grad.cuda())
            outs.append(out.detach())
        (ids, offsets, grad) = small[0]
        first, second = emb(ids, torch.arange(0, 80, 16)), emb(ids, offsets)
        (first * grad[:5].cuda()).sum().add((second * grad.cuda()).sum()).backward()
        with torch.no_grad():
            outs += [first.detach(), second.detach(), emb(*small[1][:2])]
        first, second = emb(*small[2][:2]), emb(*wide[:2])  # (the second grows the tier)
        (first * small[2][2].cuda()).sum().add((second * wide[2].cuda()).sum()).backward()
        outs += [first.detach(), second.detach()]
        for ids, offsets, grad in small:
            out = emb(ids, offsets)
            out.backward(grad.cuda())
            outs.append(out.detach())
        stats = emb.stats()
        stats["prefetch"].pop("wait_seconds")
        tier = emb._store.tier0
        assert tier.index.pinned == 0 and tier.pinned_ids == 0 and tier.generation == 1
        runs.append((torch.cat([o.reshape(-1) for o in outs]).cpu(), _table(emb), stats))
        made.append(emb)
    (got, got_rows, got_stats), (want, want_rows, want_stats) = runs
    assert torch.equal(got, want) and torch.equal(got_rows, want_rows) and got_stats == want_stats
    graphs = made[0]._store.tier0.graphs.stats()
    assert graphs["failed"] is None and graphs["captures"] >= 4 and graphs["replays"] >= 12
    assert made[1]._store.tier0.graphs is None
    for emb in made:
        emb.close()


def test_cuda_graphs_replay_on_the_callers_stream_and_a_flush_sees_their_updates():
    """Training on a side stream: the replayed graphs run there, the pooled rows read on that
    stream are right, and a flush from the default stream writes down every update (it waits
    for the stream the graphs ran on)."""
    kw = dict(optimizer=tieredemb.SGD(lr=0.5), seed=1)
    emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", device="cuda", **kw)
    ref = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", **kw)
    side = torch.cuda.Stream()
    data = [_shaped(k, 16, 5) for k in range(6)]
    for ids, offsets, grad in data:
        with torch.cuda.stream(side):
            out = emb(ids, offsets)
            out.backward(grad.cuda())
            got = out.detach().cpu()
        want = ref(ids, offsets)
        want.backward(grad)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    emb.flush()
    torch.testing.assert_close(_table(emb), _table(ref), rtol=1e-5, atol=1e-5)
    assert emb._store.tier0.graphs.stats()["replays"] >= 8


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_cuda_graphs_take_ids_and_offsets_checked_on_the_gpu(include_last_offset):
    """Ids and offsets given on the GPU (checked there, the verdict read with one wait) go
    through the replayed graphs too, their number varying within a shape (padded on the
    device): bit for bit as cuda_graphs=False, and a bad id is refused with nothing changed."""
    data = [_shaped(k, 16, 5, short=k % 3) for k in range(5)]
    runs, tables = [], []
    for graphs in (True, False):
        emb = tieredemb.TieredEmbeddingBag(NUM, DIM, "sum", padding_idx=5, seed=3, device="cuda", cuda_graphs=graphs,
                                           include_last_offset=include_last_offset,
                                           optimizer=tieredemb.RowWiseAdagrad(lr=0.1))
        outs = []
        for ids, offsets, grad in data:
            if include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([len(ids)])])
            out = emb(ids.cuda(), offsets.cuda())
            out.backward(grad.cuda())
            outs.append(out.detach())
        before = _table(emb)
        with pytest.raises(IndexError, match=rf"id {NUM} out of range \[0, {NUM}\)"):
            emb(torch.cat([ids[:-1], torch.tensor([NUM])]).cuda(), offsets.cuda())
        assert torch.equal(_table(emb), before)
        runs.append((torch.cat(outs).cpu(), _table(emb)))
        tables.append(emb)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert tables[0]._store.tier0.graphs.stats()["replays"] >= 5


@pytest.mark.parametrize("where", ["host", "device"])
def test_cuda_graphs_of_a_collection_train_bit_for_bit_as_kernels_launched_one_by_one(where):
    """A collection of whole tables in HBM (three groups) replays one graph each way for all its
    groups: outputs and rows bit for bit as cuda_graphs=False, features on the host or the GPU,
    their ids varying in number within a shape."""
    tables = [tieredemb.EmbeddingBagConfig("u", 120, DIM, ["a", "b"]),
              tieredemb.EmbeddingBagConfig("v", 80, DIM, ["c"], pooling="mean"),
              tieredemb.EmbeddingBagConfig("w", 40, 8, ["d"])]
    runs, made = [], []
    for graphs in (True, False):
        col = tieredemb.TieredEmbeddingBagCollection(tables, optimizer=tieredemb.RowWiseAdagrad(lr=0.1), seed=3,
                                                     device="cuda", cuda_graphs=graphs)
        g = torch.Generator().manual_seed(2)
        outs = []
        for step in range(6):
            feats = {}
            for t in tables:
                for f in t.feature_names:
                    n = 40 - (step + ord(f)) % 4  # (37 to 40 ids a feature: one shape, padded)
                    ids, starts = torch.randint(0, t.num_embeddings, (n,), generator=g), torch.arange(0, 32, 4)
                    feats[f] = (ids.cuda(), starts.cuda()) if where == "device" else (ids, starts)
            out = col(feats)
            out.values().backward(torch.randn(out.values().shape, generator=g).cuda())
            outs.append(out.values().detach().cpu())
        rows = torch.cat([col.read_rows(t.name, torch.arange(t.num_embeddings)).reshape(-1) for t in tables])
        runs.append((torch.cat(outs), rows))
        made.append(col)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    lead = made[0].engines[0]._store.tier0.graphs.stats()
    assert lead["failed"] is None and lead["captures"] == 2 and lead["replays"] >= 6
