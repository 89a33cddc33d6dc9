"""Tests of kvredis.hashing: one module per module of the package."""
