"""Typed messages and ZeroMQ channels between the three processes. No pickle anywhere."""
