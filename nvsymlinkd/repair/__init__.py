"""Repair of containers that lost devices: plan (pure: what to grant, rate limits, history) and
apply (the cgroup and systemd writes, freeze/thaw, journal). Acts only on verify/'s Report and never
grants a device the runtime did not grant."""
