"""Timing, benchmark suites and reports."""
