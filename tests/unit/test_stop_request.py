"""The run dir's stop request (``megatron_darl.loop.stop_request``): what a file asks for, how often
rank 0 looks, and that a request is gone once its stop is done."""

import signal

from megatron_darl.loop.stop_request import (
    RequestWatch, clear_request, read_request, request_path, write_request,
)


def test_a_request_names_its_signal_and_anything_else_stops_as_usr1(tmp_path, caplog):
    path = request_path(tmp_path)
    assert read_request(path) is None  # no file: no stop
    write_request(tmp_path, signal.SIGTERM)
    assert path.read_text() == "SIGTERM\n" and read_request(path) == signal.SIGTERM
    assert not list(tmp_path.glob(".stop_request.*"))  # written whole, no temporary left
    for text, expected in (("", signal.SIGUSR1), ("term\n", signal.SIGTERM), ("SIGINT", signal.SIGINT),
                           ("USR1 please", signal.SIGUSR1)):
        path.write_text(text)
        assert read_request(path) == expected, text
    path.write_text("SIGKILL")  # not a stop signal this loop answers: a stop with no deadline
    assert read_request(path) == signal.SIGUSR1
    assert "not SIGTERM, SIGINT or SIGUSR1" in caplog.text and str(path) in caplog.text
    clear_request(tmp_path)
    clear_request(tmp_path)  # twice: no error
    assert read_request(path) is None


def test_the_watch_looks_at_most_once_per_interval_unless_asked_now_and_done_removes_it(tmp_path):
    watch = RequestWatch(tmp_path, every_s=3600.0)
    assert watch.poll() is None  # the first look
    write_request(tmp_path, signal.SIGUSR1)
    assert watch.poll() is None  # within the interval: no second stat
    assert watch.check() == signal.SIGUSR1  # a step boundary looks now
    watch.done()
    assert not request_path(tmp_path).exists()
    assert RequestWatch(tmp_path, every_s=0.0).poll() is None
    idle = RequestWatch(None)  # ranks other than 0: never a look, never a removal
    write_request(tmp_path, signal.SIGTERM)
    assert idle.poll() is None and idle.check() is None
    idle.done()
    assert request_path(tmp_path).exists()
