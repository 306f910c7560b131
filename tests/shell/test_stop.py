"""StopRequest: flags, real signals, restored handlers, and agreement across ranks."""

from __future__ import annotations

import signal
import socket
import threading

import pytest
import torch

from pitstop import PitstopError, StopRequest


def test_a_request_is_a_flag_with_the_first_reason() -> None:
    stop = StopRequest()
    assert not stop
    assert (stop.requested, stop.reason) == (False, None)
    stop.request("preempted")
    stop.request("later reason")
    assert stop
    assert (stop.requested, stop.reason) == (True, "preempted")
    assert "preempted" in repr(stop)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_only_sets_the_flag(sig: signal.Signals) -> None:
    stop = StopRequest()
    with stop.catch_signals() as caught:
        assert caught is stop
        signal.raise_signal(sig)
        assert stop.requested
        assert stop.reason == sig.name


def test_previous_handlers_come_back() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with StopRequest().catch_signals():
            assert signal.getsignal(signal.SIGTERM) is not previous
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_sigint_insists() -> None:
    stop = StopRequest()
    with stop.catch_signals():
        signal.raise_signal(signal.SIGINT)
        assert stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            signal.raise_signal(signal.SIGINT)


def test_a_sigterm_after_a_request_keeps_the_first_reason() -> None:
    stop = StopRequest()
    stop.request("manual")
    with stop.catch_signals():
        signal.raise_signal(signal.SIGTERM)  # not SIGINT: no insisting, just ignored
    assert stop.reason == "manual"


def test_catching_signals_off_the_main_thread_is_an_error() -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with StopRequest().catch_signals():
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], PitstopError)
    assert "main thread" in str(errors[0])


def test_sync_without_a_process_group_is_the_flag() -> None:
    stop = StopRequest()
    assert stop.sync() is False
    stop.request()
    assert stop.sync() is True


def test_sync_is_a_collective_in_a_process_group() -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is unavailable")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        stop = StopRequest()
        assert stop.sync() is False
        stop.request("rank 0")
        assert stop.sync() is True
    finally:
        torch.distributed.destroy_process_group()
