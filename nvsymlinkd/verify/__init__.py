"""Verification: each container's expected devices (containers/) against its effective access
(access/), its /dev nodes and its scope, into a Report of findings (evaluate decides, pure);
hostcheck does the host-wide checks. repair/ acts on the Report."""
