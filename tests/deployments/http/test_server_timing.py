"""The ingress's Server-Timing header: each phase from the end of the one before, in milliseconds."""

from __future__ import annotations

from deployments.http.server_timing import ServerTiming


def test_each_phase_lasts_from_the_last_mark_and_the_header_lists_them_in_order():
    readings = iter([10.0, 10.25, 10.2505, 11.0])  # at the start, then at each mark
    phases = ServerTiming(clock=lambda: next(readings))
    for phase in ("upload", "options", "audio"):
        phases.mark(phase)
    assert phases.header() == "upload;dur=250.0, options;dur=0.5, audio;dur=749.5"


def test_a_request_with_no_phase_marked_sends_an_empty_header():
    assert ServerTiming().header() == ""
