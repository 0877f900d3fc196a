"""Verification: compares each container's expected devices (containers/) with its effective access
(access/) and its /dev nodes into a Report of findings; hostcheck does the host-wide checks.
Pure deciding over observed facts; repair/ acts on its Report."""
