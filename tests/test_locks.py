"""The package's locks (locks.py): a signal handler's exception anywhere in `with lock:` or in a wait
leaves the lock as it was and the thread's count of held locks right; a blocked acquire or wait can be
interrupted; wait, wait_for and notify_all work as threading.Condition's. Real signals: an interval
timer's SIGALRM, whose handler raises on the main thread."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from tieredemb import locks


class Tick(Exception):
    pass


def _storm(body, seconds: float = 1.5) -> int:
    """Calls body() in a loop on the main thread for `seconds` while SIGALRM arrives every 15 us; the
    handler raises Tick once per call (it disarms itself). Returns how many calls a Tick cut short."""
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            raise Tick

    old = signal.signal(signal.SIGALRM, handler)
    hits = 0
    end = time.monotonic() + seconds
    try:
        signal.setitimer(signal.ITIMER_REAL, 1e-5, 1.5e-5)
        while time.monotonic() < end:
            try:
                armed[0] = True
                body()
                armed[0] = False
            except Tick:
                hits += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return hits


# (the storm's exceptions may land in any finalizer that runs meanwhile; Python reports those as unraisable)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("form", ["plain", "reentrant", "reentrant nested", "wait", "group"])
def test_a_handler_exception_anywhere_in_with_leaves_the_lock_free(form):
    lock = locks.Counted(reentrant=form != "plain")
    other = locks.Counted()
    guard = locks.Group([lock, other]) if form == "group" else lock

    def body():
        with guard:
            if form == "reentrant nested":
                with lock:
                    pass
            elif form == "wait":
                lock.wait(0)

    hits = _storm(body)
    assert hits > 200, f"only {hits} calls were interrupted: the storm did not test the lock"
    assert not lock.owned() and not other.owned()
    assert not locks.any_held()
    # and it is still a working lock: another thread takes it
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5)) or lock.release())
    t.start()
    t.join()
    assert got == [True]


def test_a_blocked_acquire_is_interrupted_and_takes_nothing():
    lock = locks.Counted()
    held, done = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)

    def handler(signum, frame):
        raise Tick

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        with pytest.raises(Tick):
            lock.acquire()
        assert time.monotonic() - start < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not lock.owned() and not locks.any_held()
    done.set()
    t.join()
    assert lock.acquire(timeout=5)
    assert locks.any_held()
    lock.release()
    assert not locks.any_held()


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_interrupted_wait_takes_its_holds_back_before_raising(reentrant):
    lock = locks.Counted(reentrant=reentrant)
    seen = []

    def handler(signum, frame):
        raise Tick

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Tick):
            with lock:
                if reentrant:
                    lock.acquire()
                try:
                    lock.wait()  # (no notify, no timeout: only the signal ends it)
                finally:
                    seen.append((lock.owned(), locks._C.locks_held()))
                    if reentrant:
                        lock.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert seen == [(True, 2 if reentrant else 1)]
    assert not lock.owned() and not locks.any_held()


def test_holds_are_counted_per_thread():
    plain, again = locks.Counted(), locks.Counted(reentrant=True)
    seen = []
    with plain:
        with again:
            with again:
                assert locks.any_held()
                t = threading.Thread(target=lambda: seen.append(locks.any_held()))
                t.start()
                t.join()
            assert again.owned()
        assert not again.owned() and plain.owned()
    assert seen == [False]
    assert not locks.any_held() and not plain.owned()


def test_a_plain_lock_taken_again_by_its_holder_raises_and_stays_held():
    lock = locks.Counted()
    with lock:
        with pytest.raises(RuntimeError, match="wait for itself"):
            lock.acquire()
        assert lock.acquire(blocking=False) is False
        assert lock.owned() and locks.any_held()
    assert not lock.owned() and not locks.any_held()


def test_only_the_holder_releases():
    for reentrant in (False, True):
        lock = locks.Counted(reentrant=reentrant)
        with pytest.raises(RuntimeError, match="not held"):
            lock.release()
        errors = []
        with lock:
            t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, lock.release)))
            t.start()
            t.join()
            assert lock.owned()
        assert len(errors) == 1 and not lock.owned()


@pytest.mark.parametrize("reentrant", [False, True])
def test_wait_for_gives_up_every_hold_until_notified(reentrant):
    lock = locks.Counted(reentrant=reentrant)
    go, out = [False], []

    def waiter():
        with lock:
            if reentrant:
                lock.acquire()  # a second hold: wait gives both up and takes both back
            out.append(lock.wait_for(lambda: go[0], timeout=10))
            out.append((lock.owned(), locks.any_held()))
            if reentrant:
                lock.release()
        out.append(locks.any_held())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    with lock:
        go[0] = True
        lock.notify_all()
    t.join(10)
    assert out == [True, (True, True), False]
    assert not locks.any_held()


_AT_EXIT = {
    "lock": """
import threading, time
from tieredemb import locks
lock = locks.Counted(reentrant=True)
def hold():
    with lock:
        time.sleep(30)
def wait():
    with lock:
        pass
threading.Thread(target=hold, daemon=True).start()
time.sleep(0.1)
threading.Thread(target=wait, daemon=True).start()
time.sleep(0.2)
""",
    "table": """
import threading, torch, tieredemb
emb = tieredemb.TieredEmbeddingBag(50_000, 32, mode="sum", cache_rows=5_000, ssd_path=PATH,
                                   optimizer=tieredemb.Adagrad(lr=0.1))
def watch():
    while True:
        emb.stats()
for _ in range(3):
    threading.Thread(target=watch, daemon=True).start()
for step in range(20):
    ids = torch.randint(0, 50_000, (2048,))
    emb(ids, torch.arange(0, 2048, 8)).sum().backward()
""",
}


@pytest.mark.parametrize("case", sorted(_AT_EXIT))
def test_daemon_threads_in_a_lock_or_a_native_call_at_exit_do_not_abort_it(case, tmp_path):
    """A daemon thread that takes the GIL back while the interpreter finalizes is ended by Python with
    pthread_exit, which aborted the process through the native frames (rc 134: 5 of 5 runs of the table
    case while the lock waited in slices, 1 of 5 before it, from the other native calls). Such a thread
    is parked now, as Python 3.14 does. Real subprocesses, exiting with their daemon threads blocked."""
    script = tmp_path / "exit.py"
    script.write_text(_AT_EXIT[case].replace("PATH", repr(str(tmp_path / "t"))))
    for run in range(3):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (run, done.returncode, done.stderr[-2000:])


def test_timeouts_past_the_limit_or_not_numbers_are_refused_as_threading_does():
    """The seconds overflowed the clock's ticks (undefined): acquire(timeout=1e10) with the lock held
    elsewhere returned False at once, wait(1e10) returned at once, wait_for(p, inf) spun a core."""
    lock = locks.Counted()
    for call in (lambda: lock.acquire(timeout=1e10), lambda: lock.acquire(timeout=float("inf"))):
        with pytest.raises(OverflowError, match="timeout value is too large"):
            call()
    with pytest.raises(ValueError, match="timeout must be a number, got nan"):
        lock.acquire(timeout=float("nan"))
    with lock:
        for call in (lambda: lock.wait(1e10), lambda: lock.wait_for(lambda: False, float("inf"))):
            with pytest.raises(OverflowError, match="timeout value is too large"):
                call()
        assert lock.wait_for(lambda: 0, -1) == 0  # (0 or less: the predicate once, as Condition's)
        assert lock.owned()
    assert not lock.owned() and not locks.any_held()
