"""StopRequest: flags, real signals, restored handlers, and agreement across ranks."""

from __future__ import annotations

import ctypes
import gc
import logging
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

from pitstop import PitstopError, StopRequest
from pitstop.shell import stop as stop_module


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
    sigint = signal.getsignal(signal.SIGINT)  # as this process started (SIG_IGN when run in `&`)
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with StopRequest().catch_signals():
            assert signal.getsignal(signal.SIGTERM) is not previous
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is sigint
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


# --- install() / uninstall(): handlers for a flat script ----------------------------------------


@pytest.fixture
def python_handler() -> Any:
    """A Python SIGTERM handler that records its calls; the original comes back afterwards."""
    calls: list[int] = []

    def handler(signum: int, frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler, calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_install_catches_signals_until_uninstall(python_handler: Any) -> None:
    handler, calls = python_handler
    sigint = signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    stop.install()
    try:
        assert stop.installed
        stop.install()  # twice: still the handlers from before the first install come back
        signal.raise_signal(signal.SIGTERM)
        assert stop.reason == "SIGTERM"
        assert calls == []
    finally:
        stop.uninstall()
    assert not stop.installed
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getsignal(signal.SIGINT) is sigint
    signal.raise_signal(signal.SIGTERM)
    assert calls == [signal.SIGTERM]
    stop.uninstall()  # not installed: nothing to do


def test_install_off_the_main_thread_is_an_error() -> None:
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(errors, StopRequest().install))
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], PitstopError)
    assert "install() must run in the main thread" in str(errors[0])


def _capture(errors: list[BaseException], call: Any) -> None:
    try:
        call()
    except BaseException as exc:
        errors.append(exc)


def test_entering_catch_signals_without_a_with_block_is_loud_and_keeps_the_handlers(
    python_handler: Any,
) -> None:
    """The flat-script misuse: the context object is collected at once. Before, that restored
    the previous handlers silently and SIGTERM then killed the run."""
    handler, calls = python_handler
    stop = StopRequest()
    with pytest.warns(RuntimeWarning, match=r"entered but never exited.*stop\.install\(\)"):
        stop.catch_signals().__enter__()  # collected at once: nothing refers to the context
    try:
        assert stop.installed
        signal.raise_signal(signal.SIGTERM)
        assert stop.reason == "SIGTERM"
        assert calls == []
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_scope_used_as_a_with_block_neither_warns_nor_stays_installed() -> None:
    stop = StopRequest()
    scope = stop.catch_signals()
    with scope, pytest.raises(PitstopError, match="already active"):
        scope.__enter__()
    del scope
    gc.collect()  # filterwarnings=error: a warning here would fail the test
    assert not stop.installed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# --- a previous handler installed outside Python ------------------------------------------------


def test_a_previous_c_handler_is_put_back(tmp_path: Any) -> None:
    """signal.getsignal() is None for a handler a C library installed. catch_signals() used to
    raise TypeError restoring it; now the C-level disposition itself comes back. Simulated in a
    child: SIG_IGN set through the C library behind Python's back, and getsignal()/signal()
    patched to report None for it, as they do for a real C handler."""
    if sys.platform == "win32" or not hasattr(ctypes.CDLL(None), "sigaction"):
        pytest.skip("no C library sigaction() here")
    child = textwrap.dedent(
        """
        import ctypes, os, signal
        from pitstop.shell.stop import StopRequest

        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), 1)  # SIG_IGN, set where Python cannot see it

        real_getsignal, real_signal = signal.getsignal, signal.signal
        outside = {signal.SIGTERM}

        def getsignal(sig):
            return None if sig in outside else real_getsignal(sig)

        def fake_signal(sig, handler):
            previous = real_signal(sig, handler)
            if sig in outside:
                outside.discard(sig)
                return None
            return previous

        signal.getsignal, signal.signal = getsignal, fake_signal
        stop = StopRequest()
        with stop.catch_signals():
            signal.raise_signal(signal.SIGTERM)
        assert stop.reason == "SIGTERM", stop.reason
        os.kill(os.getpid(), signal.SIGTERM)  # ignored again, at the C level
        print("alive")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.strip() == "alive"


def test_a_c_handler_that_cannot_be_put_back_leaves_the_default_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_signal = signal.signal
    sigint = signal.getsignal(signal.SIGINT)
    reported_none = {signal.SIGTERM}

    def fake_signal(sig: int, handler: Any) -> Any:
        previous = real_signal(sig, handler)
        if sig in reported_none:
            reported_none.discard(signal.Signals(sig))
            return None
        return previous

    monkeypatch.setattr(signal, "getsignal", lambda sig: None)
    monkeypatch.setattr(signal, "signal", fake_signal)
    monkeypatch.setattr(stop_module, "_c_disposition", lambda sig: None)  # no sigaction()
    stop = StopRequest()
    with caplog.at_level(logging.WARNING, logger="pitstop"), stop.catch_signals():
        pass  # no TypeError on the way out
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert "previous SIGTERM handler was installed outside Python" in caplog.text
    assert signal.getsignal(signal.SIGINT) is sigint


def test_a_signal_landing_inside_an_agreement_is_never_lost(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGTERM raised while a save call adopts its agreement (after the new state was
    computed, before it is kept): the request stands, and the next call saves the stop. It was
    lost when the handler wrote the state the agreement then overwrote (`pitstop train` kept
    training after a SIGTERM, about one run in thirty)."""
    from pitstop import Checkpointer, Policy, Progress

    real = stop_module.agreed
    raised: list[bool] = []

    def agreed_then_signal(*args: Any, **kwargs: Any) -> Any:
        state = real(*args, **kwargs)
        if not raised:
            raised.append(True)
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, before the return
        return state

    monkeypatch.setattr(stop_module, "agreed", agreed_then_signal)
    stop = StopRequest()
    model = torch.nn.Linear(2, 2)
    with stop.catch_signals(), Checkpointer(tmp_path, model=model, policy=Policy()) as ckpt:
        assert ckpt.maybe_save(Progress(step=1), stop=stop) is None  # agreed before the signal
        assert raised
        assert (stop.requested, stop.reason) == (True, "SIGTERM")
        saved = ckpt.maybe_save(Progress(step=2), stop=stop)
    assert saved is not None
    assert saved.detail == "SIGTERM"
