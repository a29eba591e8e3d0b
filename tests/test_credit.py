"""Delivery credit per follower (node/core/credit.py, sans-IO, explicit time): the window's ends, where a rate's span
starts, and rows forgotten once their deliveries left the window."""

from __future__ import annotations

import pytest

from murmur.node.core.credit import MIN_SPAN_S, SLACK, WINDOW_S, Deliveries


def test_a_rate_divides_by_the_time_since_the_first_delivery_at_least_min_span_s() -> None:
    d = Deliveries()
    d.add("p", 30, 100.0)
    d.add("p", 30, 120.0)
    assert d.rate("p", 120.0) == pytest.approx(60 / 20.0)
    assert d.rate("p", 101.0) == pytest.approx(60 / MIN_SPAN_S)  # one batch is not a rate
    assert d.backed("p", 120.0) == pytest.approx(SLACK * 3.0)
    assert d.credit("p", 120.0) == 0.0  # no sampled check passed yet: delivery earns no credit
    d.vouch("p")
    assert d.credit("p", 120.0) == pytest.approx(SLACK * 3.0)
    assert d.rate("never", 120.0) == 0.0


def test_a_delivery_exactly_window_s_old_has_left_the_window() -> None:
    d = Deliveries()
    d.add("p", 10, 0.0)
    d.add("p", 20, 1.0)
    assert d.rate("p", WINDOW_S) == pytest.approx(20 / WINDOW_S)
    assert d.rate("p", WINDOW_S + 1.0) == 0.0


def test_a_follower_whose_deliveries_all_left_the_window_starts_over() -> None:
    d = Deliveries()
    d.add("p", 10, 0.0)
    assert d.rate("p", 100.0) == 0.0
    d.add("p", 10, 200.0)
    assert d.rate("p", 200.0) == pytest.approx(10 / MIN_SPAN_S)  # not 10 / WINDOW_S from a start at 0


def test_nothing_delivered_starts_no_span() -> None:
    d = Deliveries()
    d.add("p", 0, 0.0)
    d.add("p", -5, 10.0)
    d.add("p", 60, 50.0)
    assert d.rate("p", 50.0) == pytest.approx(60 / MIN_SPAN_S)
