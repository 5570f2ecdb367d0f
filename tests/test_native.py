"""The native core's own contracts: thread-count independence, dedup, lazy host pools."""

import torch

import tieredemb
from tieredemb import _C


def _train(threads):
    _C.set_num_threads(threads)
    try:
        emb = tieredemb.TieredEmbeddingBag(5000, 32, mode="mean", cache_rows=900,
                                           optimizer=tieredemb.RowWiseAdagrad(lr=0.1))
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            ids = torch.randint(0, 5000, (800,), generator=g)
            emb(ids, torch.arange(0, 800, 8)).backward(torch.randn(100, 32, generator=g))
        return emb.read_rows(torch.arange(5000))
    finally:
        _C.set_num_threads(torch.get_num_threads())


def test_results_do_not_depend_on_thread_count_and_pool_restarts():
    """Threads take chunks of a loop in turn, so the cuts move with the thread count (5 threads on
    this 2-core machine also leaves workers that wake after the chunks ran out). Also a regression
    test: workers restarted by set_num_threads once reran a stale call."""
    one, two, five, one_again = _train(1), _train(2), _train(5), _train(1)
    assert torch.equal(one, two) and torch.equal(one, five) and torch.equal(one, one_again)


def test_loops_from_two_threads_at_once_give_the_same_rows():
    """A loop started while another thread's loop holds the pool runs inline on its own thread."""
    import threading

    reference = _train(2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_train(2))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(torch.equal(r, reference) for r in results)


def test_dedup_keeps_first_occurrence_order_and_inverse():
    ids = torch.tensor([7, 3, 7, 9, 3, 3, 0], dtype=torch.int64)
    unique, inverse = _C.dedup(ids, 10)
    assert unique.tolist() == [7, 3, 9, 0]
    assert torch.equal(torch.from_numpy(unique)[torch.from_numpy(inverse)], ids)


def test_dedup_of_a_large_batch_with_many_distinct_ids():
    ids = torch.randint(0, 10**9, (300_000,), generator=torch.Generator().manual_seed(1))
    unique, inverse = _C.dedup(ids, 10**9)
    assert torch.equal(torch.from_numpy(unique)[torch.from_numpy(inverse)], ids)
    assert len(unique) == len(torch.unique(ids))
